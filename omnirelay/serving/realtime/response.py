"""One realtime session's responses: :class:`ResponseRunner` starts, streams, cancels and ends them.

A response is one pipeline request for the whole conversation so far (the session's
instructions, then every item), admitted like any request. Its outputs become
``response.audio_transcript.delta`` / ``response.text.delta`` and ``response.audio.delta``
events; it ends once, with ``response.done``, whichever comes first: its last output, a
failure, ``response.cancel`` or a barge-in. Ending is synchronous up to the first send
(:attr:`Response.is_over`), and every delta is sent only if its response is not over,
checked under the session's send lock, so nothing of a response follows its
``response.done``. A cancel aborts the request through every stage
(:meth:`~omnirelay.serving.frontend.RequestStream.abort`); the task reading it ends at
the request's last output and frees its admission slot.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from starlette.websockets import WebSocketDisconnect

from omnirelay.api import TRANSCRIPT, RequestOutput
from omnirelay.errors import RequestFailedError, StageUnavailableError
from omnirelay.models.family import Detokenizer
from omnirelay.models.inputs import AUDIO_INPUT_RATE, audio_inputs
from omnirelay.serving.errors import ApiError, request_failed
from omnirelay.serving.frontend import UNTIL_FIRST, RequestStream
from omnirelay.serving.media.audio_out import AudioEmitter, AudioStreamError
from omnirelay.serving.media.chat_turns import submit_turns
from omnirelay.serving.media.encoding import PcmResampler
from omnirelay.serving.realtime.conversation import Item
from omnirelay.serving.realtime.events import EventError, RealtimeSettings, new_id
from omnirelay.serving.realtime.tools import CallRelay, tool_prompt

if TYPE_CHECKING:
    from omnirelay.serving.realtime.session import Session

__all__ = ["Response", "ResponseRunner"]

logger = logging.getLogger(__name__)
#: how long a closing session waits for its response's request to end after the abort
SHUTDOWN_WAIT_S = 5.0


@dataclass(eq=False)
class Response:
    id: str
    item: Item
    settings: RealtimeSettings
    prompt: list[int]
    stream: RequestStream | None = None
    is_over: bool = False
    text: list[str] = field(default_factory=list)
    num_output_tokens: int = 0
    #: the prompt the text stage computed (behind a recognizer the front never sees it)
    num_prompt_tokens: int | None = None
    num_audio_samples: int = 0
    task: asyncio.Task[None] | None = None
    detok: Detokenizer | None = None
    #: the answer's audio from the pipeline's rate to the session's (made at its first audio)
    resampler: PcmResampler | None = None
    #: the speech items whose clips the request hears (the recognizer's transcripts, in order)
    heard: list[Item] = field(default_factory=list)
    #: the answer's calls (:mod:`omnirelay.serving.realtime.tools`): None when it may call none
    relay: CallRelay | None = None
    #: its ``function_call`` items, output items 1, 2, … after the message
    calls: list[Item] = field(default_factory=list)

    @property
    def has_audio(self) -> bool:
        return "audio" in self.settings.modalities

    @property
    def input_tokens(self) -> int:
        return self.num_prompt_tokens if self.num_prompt_tokens is not None else len(self.prompt)

    def ids(self) -> dict[str, Any]:
        return {"response_id": self.id, "item_id": self.item.id, "output_index": 0, "content_index": 0}

    def body(self, status: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
        """OpenAI's ``response`` object."""
        items = [self.item, *self.calls]
        output = [] if status == "in_progress" or self.stream is None else [i.event_item() for i in items]
        extra = {} if self.settings.metadata is None else {"metadata": self.settings.metadata}
        return {
            **extra,
            "id": self.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": output,
            "modalities": list(self.settings.modalities),
            "voice": self.settings.voice,
            "output_audio_format": "pcm16",
            "usage": {
                "input_tokens": self.input_tokens,
                "output_tokens": self.num_output_tokens,
                "total_tokens": self.input_tokens + self.num_output_tokens,
            },
        }


class ResponseRunner:
    """The responses of one session (at most one in flight: :attr:`current`)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.current: Response | None = None
        #: a turn ended while :attr:`current` played: answer the conversation once it is done
        self.answer_next = False
        self._tasks: set[asyncio.Task[None]] = set()
        #: transcription-only requests in flight (aborted when the session closes)
        self._transcriptions: set[RequestStream] = set()

    async def start(self, settings: RealtimeSettings) -> None:
        """``response.create``: answer the conversation as it is now."""
        s = self.session
        if self.current is not None:
            raise EventError(
                f"response {self.current.id!r} is in progress; cancel it or wait for response.done",
                code="conversation_already_has_active_response",
            )
        if not s.conversation.has_user_turn:
            raise EventError(
                "the conversation has no user message to answer; add one first", code="empty_conversation"
            )
        turns = s.conversation.turns(settings.instructions)
        heard = s.conversation.unheard()  # their clips are in the turns, in this order
        try:
            s.fe.check_text("".join(p for _, ps in turns for p in ps if isinstance(p, str)), "conversation")
            sampling = s.fe.sampling(max_tokens=settings.max_output_tokens, temperature=settings.temperature)
        except ApiError as exc:
            raise EventError(exc.message, code=exc.code or "invalid_value", param=exc.param) from exc
        tooling = tool_prompt(s.fe, settings, s)
        kind = "audio" if "audio" in settings.modalities else "text"
        item = Item(id=new_id("item"), role="assistant", kind=kind, status="in_progress")
        resp = Response(new_id("resp"), item, settings, [], heard=heard)
        fmt = s.fe.prompts.tool_format
        if tooling is not None and tooling.tools and fmt is not None:
            resp.relay = CallRelay(fmt.parser(tooling.prefix))
        try:
            # A user's speech enters the way chat's input_audio does (a recognizer stage,
            # or the Thinker's audio encoder); text-only turns make the plain chat prompt.
            resp.stream, resp.prompt = submit_turns(
                s.fe,
                endpoint="realtime",
                turns=turns,
                modalities=("text", "audio") if kind == "audio" else ("text",),
                request_id=resp.id,
                sampling=sampling,
                extras={"voice": settings.voice} if kind == "audio" else {},
                session=s.id,  # a replicated stage keeps the session's turns on one replica
                delivery=UNTIL_FIRST,  # runs again on a lost replica until its first event
                tooling=tooling,
            )
        except ApiError as exc:
            await self._refused(resp, exc)
            return
        self.current = resp
        self.answer_next = False  # this response hears every turn so far
        await s.send("response.created", {"response": resp.body("in_progress")})
        await s.send(
            "response.output_item.added",
            {"response_id": resp.id, "output_index": 0, "item": item.event_item()},
        )
        previous = s.conversation.last_id
        await s.add_item(item, previous)
        part = {"type": kind, "transcript": ""} if kind == "audio" else {"type": "text", "text": ""}
        await s.send("response.content_part.added", {**resp.ids(), "part": part})
        resp.task = asyncio.create_task(self._guarded(resp), name=f"realtime-{resp.id}")
        self._tasks.add(resp.task)
        resp.task.add_done_callback(self._tasks.discard)

    async def _refused(self, resp: Response, exc: ApiError) -> None:
        """Not admitted (over capacity, a stage down): ``error``, then a failed ``response.done``."""
        s = self.session
        retry = exc.headers.get("Retry-After")
        err = EventError(exc.message, code=exc.code or exc.type, type=exc.type)
        error: dict[str, Any] = {"type": err.type, "code": err.code, "message": err.message, "param": None}
        if retry is not None and retry.isdigit():
            error["retry_after_s"] = int(retry)
        await s.send("error", {"error": {**error, "event_id": None}})
        await s.send("response.created", {"response": resp.body("in_progress")})
        await s.send("response.done", {"response": resp.body("failed", {"type": "failed", "error": error})})

    async def cancel(self, reason: str) -> None:
        """End the response in flight as ``cancelled`` (``reason``: ``turn_detected`` or
        ``client_cancelled``) and abort its request through every stage; no-op without one."""
        resp = self.current
        if resp is None or resp.is_over:
            return
        assert resp.stream is not None
        resp.stream.abort(reason)
        await self._finish(resp, "cancelled", {"type": "cancelled", "reason": reason})

    async def _guarded(self, resp: Response) -> None:
        try:
            await self._run(resp)
        except (WebSocketDisconnect, OSError, RuntimeError):
            pass  # the client is gone; the session's loop sees it and shuts down
        except Exception:  # a bug: logged; the session goes on without this response
            logger.exception("realtime response %s failed", resp.id)

    async def _run(self, resp: Response) -> None:
        assert resp.stream is not None
        emitter = AudioEmitter() if resp.has_audio else None
        status: str = "completed"
        details: dict[str, Any] | None = None
        try:
            async for out in resp.stream:
                if resp.is_over:
                    break
                await self._output(resp, out, emitter)
                # The answer's text stage ran out of tokens (its end, not the request's: a
                # spoken answer's last output is the voice's, which ends it normally).
                if out.modality == "text" and out.stage_finished and out.finish_reason == "length":
                    status, details = "incomplete", {"type": "incomplete", "reason": "max_output_tokens"}
        except RequestFailedError as exc:
            err = request_failed(exc)
            code = StageUnavailableError.code if isinstance(exc, StageUnavailableError) else "response_failed"
            status = "failed"
            details = {"type": "failed", "error": {"type": err.type, "code": code, "message": err.message}}
        except AudioStreamError as exc:
            resp.stream.abort("bad_audio")
            status = "failed"
            details = {
                "type": "failed",
                "error": {"type": "server_error", "code": "bad_audio", "message": str(exc)},
            }
        finally:
            resp.stream.close()
        if status == "completed" and resp.resampler is not None:
            await self._audio_delta(resp, resp.resampler.flush())  # what the resampler held back
        if resp.relay is not None and not resp.is_over:  # text held back as a possible call's start
            await self._say(resp, await resp.relay.finish(self.session, resp))
        await self._finish(resp, status, details)

    async def _output(self, resp: Response, out: RequestOutput, emitter: AudioEmitter | None) -> None:
        s = self.session
        if out.modality == TRANSCRIPT:
            await self._heard(resp.heard, out.text or "")
        elif out.modality == "text":
            piece = self._text_of(resp, out)
            if piece and resp.relay is not None:
                piece = await resp.relay.push(s, resp, piece)
            await self._say(resp, piece)
        elif out.modality == "audio" and emitter is not None:
            new = emitter.push(out.audio, out.sample_rate)
            if new is None or new.numel() == 0:
                return
            rate = emitter.sample_rate
            assert rate is not None and resp.stream is not None
            if resp.resampler is None:  # the pipeline's rate → the session's (24 kHz)
                resp.resampler = PcmResampler(rate, s.rate)
            resp.stream.note_audio_sent(new.numel(), rate)
            await self._audio_delta(resp, resp.resampler.push(new.numpy()))

    async def _say(self, resp: Response, piece: str) -> None:
        if piece:
            resp.text.append(piece)
            kind = "response.audio_transcript.delta" if resp.has_audio else "response.text.delta"
            await self.session.send(kind, {**resp.ids(), "delta": piece}, unless=resp)

    async def _audio_delta(self, resp: Response, data: bytes) -> None:
        if not data:
            return
        resp.num_audio_samples += len(data) // 2
        resp.item.output_samples = resp.num_audio_samples
        encoded = base64.b64encode(data).decode("ascii")
        await self.session.send("response.audio.delta", {**resp.ids(), "delta": encoded}, unless=resp)

    async def _heard(self, items: list[Item], text: str) -> None:
        """The recognizer's transcripts (one line per clip) become the items' text, said
        once each when the session transcribes its input."""
        for item, line in zip(items, text.split("\n")):
            if item.is_heard:
                continue
            item.is_heard, item.text = True, line
            if self.session.settings.transcription is not None:
                seconds = round(item.audio.size / AUDIO_INPUT_RATE, 3)  # what the recognizer heard
                await self.session.send(
                    "conversation.item.input_audio_transcription.completed",
                    {
                        "item_id": item.id,
                        "content_index": 0,
                        "transcript": line,
                        "usage": {"type": "duration", "seconds": seconds},
                    },
                )

    def transcribe(self, item: Item) -> None:
        """Ask the pipeline what ``item``'s speech says (the transcript alone: the request
        ends at the recognizer), in a task of its own; a failure is
        ``conversation.item.input_audio_transcription.failed``."""
        task = asyncio.create_task(self._guarded_transcription(item), name=f"realtime-asr-{item.id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _guarded_transcription(self, item: Item) -> None:
        try:
            await self._transcription(item)
        except (WebSocketDisconnect, OSError, RuntimeError):
            pass  # the client is gone
        except Exception:  # a bug: logged; the session goes on
            logger.exception("realtime transcription of %s failed", item.id)

    async def _transcription(self, item: Item) -> None:
        s = self.session
        entry = s.fe.pipeline.config.audio_entry_stage_id
        assert entry is not None  # Invariant: session.update refuses transcription without one
        error: dict[str, Any] | None = None
        try:
            stream = s.fe.submit(
                endpoint="realtime",
                prompt_token_ids=[0],
                modalities=[TRANSCRIPT],
                request_id=new_id("asr"),
                inputs=audio_inputs([item.audio]),
                entry_stage_id=entry,
            )
        except ApiError as exc:
            error = {"type": exc.type, "code": exc.code, "message": exc.message}
        else:
            self._transcriptions.add(stream)
            try:
                async for out in stream:
                    if out.modality == TRANSCRIPT:
                        await self._heard([item], out.text or "")
            except RequestFailedError as exc:
                err = request_failed(exc)
                error = {"type": err.type, "code": err.code or "transcription_failed", "message": err.message}
            finally:
                self._transcriptions.discard(stream)
                stream.close()
        if error is not None and not item.is_heard:
            await s.send(
                "conversation.item.input_audio_transcription.failed",
                {"item_id": item.id, "content_index": 0, "error": error},
            )

    def _text_of(self, resp: Response, out: RequestOutput) -> str:
        resp.num_output_tokens += len(out.token_ids)
        if out.stage_finished and "num_prompt_tokens" in out.metrics:
            resp.num_prompt_tokens = int(out.metrics["num_prompt_tokens"])
        if out.text is not None:
            return out.text
        if resp.detok is None:
            resp.detok = self.session.fe.prompts.detokenizer(resp.prompt)
        piece = resp.detok.push(out.token_ids) if out.token_ids else ""
        return piece + resp.detok.flush() if out.stage_finished else piece

    async def _finish(self, resp: Response, status: str, details: dict[str, Any] | None) -> None:
        """End ``resp`` once: its item keeps the text sent so far; the done events follow."""
        if resp.is_over:
            return
        resp.is_over = True  # from here no delta of it is sent (see Session.send)
        if self.current is resp:
            self.current = None
        s = self.session
        resp.item.text = "".join(resp.text)
        resp.item.status = "completed" if status == "completed" else "incomplete"
        for call in resp.calls:  # a call cut before its end is no call (the prompt skips it)
            call.status = "completed" if call.status == "completed" else "incomplete"
        ids = resp.ids()
        if resp.has_audio:
            await s.send("response.audio.done", ids)
            await s.send("response.audio_transcript.done", {**ids, "transcript": resp.item.text})
            part = {"type": "audio", "transcript": resp.item.text}
        else:
            await s.send("response.text.done", {**ids, "text": resp.item.text})
            part = {"type": "text", "text": resp.item.text}
        await s.send("response.content_part.done", {**ids, "part": part})
        await s.send(
            "response.output_item.done",
            {"response_id": resp.id, "output_index": 0, "item": resp.item.event_item()},
        )
        await s.send("response.done", {"response": resp.body(status, details)})
        await s.notify_dropped(s.conversation.trim())
        if self.answer_next and self.current is None:
            self.answer_next = False  # asked once: a refused answer is said, not retried
            try:
                await self.start(s.settings)
            except EventError as exc:
                await s.send_error(exc)

    async def shutdown(self) -> None:
        """The session is closing: abort what is in flight and wait for its request to end."""
        resp = self.current
        if resp is not None and resp.stream is not None:
            resp.is_over = True
            self.current = None
            resp.stream.abort("client_disconnect")
        for stream in list(self._transcriptions):
            stream.abort("client_disconnect")
        tasks = list(self._tasks)
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=SHUTDOWN_WAIT_S)
        for task in pending:  # a request that does not end: stop reading it (close aborts it)
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.gather(*tasks, return_exceptions=True)
