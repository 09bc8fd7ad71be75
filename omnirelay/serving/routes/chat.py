"""``POST /v1/chat/completions`` (docs/protocol.md §7.1), OpenAI's schema with audio output.

* ``modalities`` ``["text"]``, ``["text", "audio"]`` (or ``["audio"]``); absent: text
  only, as OpenAI's (or the pipeline file's ``default_modalities``). ``audio`` {voice,
  format: ``wav``, ``mp3``, ``opus``, ``aac``, ``flac`` or ``pcm16``: OpenAI's formats, see
  :mod:`omnirelay.serving.media.encoding`}.
* ``stream: false`` — one ``chat.completion``. Text only: ``message.content`` is the
  text. With audio, as OpenAI's: the spoken text is the audio's transcript,
  ``message.audio`` {id, data: base64 of the whole file, transcript, expires_at}, and
  ``message.content`` is null. Stages still overlap inside the pipeline; only the answer
  waits for the end.
* ``stream: true`` — SSE ``chat.completion.chunk`` s: a role chunk, then text deltas —
  ``delta.content`` for a text answer, ``delta.audio.transcript`` for a spoken one —
  and ``delta.audio.data`` audio deltas (base64 of the encoder's bytes as they are ready;
  their concatenation is the file, a ``wav`` one with a header of unknown length), a last
  audio update with ``expires_at``, the finish chunk, a usage chunk when
  ``stream_options.include_usage``, then ``data: [DONE]``. ``pcm16`` is 24 kHz, as
  OpenAI's (:data:`~omnirelay.serving.media.encoding.PCM_RATE`).
* ``stop`` (up to 4 strings) ends the answer at the first match (the request is aborted
  through every stage); ``max_tokens`` / ``max_completion_tokens``, ``temperature``,
  ``top_p`` and ``seed`` set the first stage's sampling.
* ``tools`` (function tools), ``tool_choice``, ``parallel_tool_calls``, assistant
  messages with ``tool_calls`` and ``tool`` messages, on a model whose chat template takes
  tools (:mod:`omnirelay.serving.tools`): the answer's calls are ``message.tool_calls`` /
  index-keyed ``delta.tool_calls``, ``finish_reason`` ``tool_calls``; with audio, only
  where the pipeline's voice leaves the calls out (the voice pipeline's Thinker does).
* What omnirelay cannot do is refused with a 400 naming the field, never ignored: tools
  on a model that takes none, the deprecated function calls, ``n > 1``, a
  ``response_format`` other than text, log
  probabilities, ``logit_bias``, penalties, a null user message, image parts, audio parts
  on a pipeline that cannot hear.
* ``input_audio`` parts of user messages ({``data``: base64, ``format``: ``wav``, ``mp3``
  or ``pcm16``, raw 16-bit mono at 24 kHz}) are decoded within the server's limits
  (``max_audio_input_bytes``, ``max_audio_input_s``: a 400 naming the limit) and heard by
  the pipeline (:mod:`omnirelay.serving.media.chat_turns`).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omnirelay.api import RequestOutput
from omnirelay.errors import OmniRelayError, RequestFailedError
from omnirelay.models.family import Detokenizer, PromptSide
from omnirelay.models.tools import ToolCall
from omnirelay.serving.errors import ApiError, error_body, request_failed, stream_error_body
from omnirelay.serving.frontend import STOP_SEQUENCE, STREAMED, WHOLE, Frontend, RequestStream
from omnirelay.serving.media.audio_out import AudioEmitter, AudioStreamError
from omnirelay.serving.media.chat_turns import decode_turns, hears_audio, sees_images, submit_turns
from omnirelay.serving.media.encoding import AudioEncoder
from omnirelay.serving.protocol import ChatCompletionRequest, check_request_id, parse, read_json_body
from omnirelay.serving.streaming import ClientGone, ClosingStreamingResponse, until_disconnect
from omnirelay.serving.tools import ChatTools, read_chat_tools_request

__all__ = ["StopMatcher", "chat_completions"]

#: ``audio.format`` → the encoder's format (OpenAI names raw PCM ``pcm16`` here)
AUDIO_FORMATS = {"wav": "wav", "mp3": "mp3", "opus": "opus", "aac": "aac", "flac": "flac", "pcm16": "pcm"}
MAX_STOPS = 4
AUDIO_TTL_S = 3600


class StopMatcher:
    """Cuts a text stream at the first of its stop sequences.

    Text that could be the start of a stop sequence is held back until the next delta
    decides; :meth:`finish` returns what is held at the end.
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._hold = max((len(s) for s in self.stops), default=1) - 1
        self._held = ""
        self.is_stopped = False

    def push(self, text: str) -> str:
        if self.is_stopped or not text:
            return ""
        if not self.stops:
            return text
        combined = self._held + text
        hits = [i for i in (combined.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.is_stopped = True
            self._held = ""
            return combined[: min(hits)]
        cut = max(0, len(combined) - self._hold)
        self._held = combined[cut:]
        return combined[:cut]

    def finish(self) -> str:
        held, self._held = self._held, ""
        return "" if self.is_stopped else held


@dataclass
class _Answer:
    """What one chat request produced so far (both response kinds fill it)."""

    stream: RequestStream
    prompts: PromptSide
    prompt: list[int]
    stops: StopMatcher
    audio: AudioEmitter | None
    text: list[str] = field(default_factory=list)
    num_completion_tokens: int = 0
    text_finish_reason: str | None = None
    last_finish_reason: str | None = None
    #: the prompt the text stage computed (its final metrics): the front's prompt is not
    #: the one computed when a recognizer's transcript made it
    num_prompt_tokens: int | None = None
    _detok: Detokenizer | None = None

    def fresh(self) -> _Answer:
        """An empty answer to the same request (it starts over)."""
        return _Answer(
            stream=self.stream,
            prompts=self.prompts,
            prompt=self.prompt,
            stops=StopMatcher(self.stops.stops),
            audio=None if self.audio is None else _fresh_emitter(self.audio),
        )

    def text_of(self, out: RequestOutput) -> str:
        """The new visible text of a text output (stop sequences applied)."""
        if self.stops.is_stopped:
            return ""
        if out.text is not None:
            raw = out.text
        else:  # a stage that reports ids only: detokenize here
            if self._detok is None:
                self._detok = self.prompts.detokenizer(self.prompt)
            raw = self._detok.push(out.token_ids) if out.token_ids else ""
            if out.stage_finished:
                raw += self._detok.flush()
        self.num_completion_tokens += len(out.token_ids)
        if out.stage_finished:
            self.text_finish_reason = out.finish_reason
            if "num_prompt_tokens" in out.metrics:
                self.num_prompt_tokens = int(out.metrics["num_prompt_tokens"])
        piece = self.stops.push(raw)
        if out.stage_finished:
            piece += self.stops.finish()
        if self.stops.is_stopped:
            self.stream.abort(STOP_SEQUENCE)
        self.text.append(piece)
        return piece

    def audio_of(self, out: RequestOutput) -> tuple[Any, int] | None:
        """New samples of an audio output and their rate (None: nothing new)."""
        if self.audio is None or self.stops.is_stopped:
            return None
        new = self.audio.push(out.audio, out.sample_rate)
        if new is None:
            return None
        rate = self.audio.sample_rate
        assert rate is not None  # Invariant: set by the first push that returned samples
        self.stream.note_audio_sent(new.numel(), rate)
        return new, rate

    @property
    def finish_reason(self) -> str:
        if self.stops.is_stopped:
            return "stop"
        reason = self.text_finish_reason or self.last_finish_reason
        return reason if reason in ("stop", "length") else "stop"

    def usage(self) -> dict[str, int]:
        prompt = self.num_prompt_tokens if self.num_prompt_tokens is not None else len(self.prompt)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": self.num_completion_tokens,
            "total_tokens": prompt + self.num_completion_tokens,
        }


def _fresh_emitter(emitter: AudioEmitter) -> AudioEmitter:
    return AudioEmitter(
        emitter.kind,
        require_sample_rate=emitter.require_sample_rate,
        default_sample_rate=emitter.default_sample_rate,
    )


def _stops(value: str | list[str] | None) -> list[str]:
    stops = [value] if isinstance(value, str) else list(value or [])
    if len(stops) > MAX_STOPS:
        raise ApiError(400, f"stop has {len(stops)} sequences; at most {MAX_STOPS} are allowed", param="stop")
    return stops


def _audio_params(
    fe: Frontend, req: ChatCompletionRequest, modalities: Sequence[str]
) -> tuple[str, str] | None:
    if "audio" not in modalities:
        if req.audio is not None:
            raise ApiError(
                400, "audio parameters were given but 'audio' is not in modalities; add it", param="audio"
            )
        return None
    fmt = (req.audio.format if req.audio else None) or ("pcm16" if req.stream else "wav")
    if fmt not in AUDIO_FORMATS:
        raise ApiError(
            400,
            f"audio.format {fmt!r} is not supported; supported formats: {list(AUDIO_FORMATS)}",
            param="audio.format",
        )
    voice = fe.check_voice(req.audio.voice if req.audio else None)
    return fmt, voice


async def chat_completions(request: Request, fe: Frontend) -> Response:
    body = await read_json_body(request, fe.config.max_body_bytes)
    req = parse(ChatCompletionRequest, body)
    fe.check_model(req.model)
    req.unsupported()
    modalities = fe.chat_modalities(req.modalities)
    audio = _audio_params(fe, req, modalities)
    tools = read_chat_tools_request(req, fe.prompts, fe.model_name)
    if tools is not None and audio is not None and not fe.prompts.voice_skips_tool_calls:
        raise ApiError(
            400,
            "this pipeline's voice would read the tool calls aloud: tools are supported with a "
            "text answer only here; ask for modalities ['text']",
            param="modalities",
            code="unsupported_parameter",
        )
    takes_audio = hears_audio(fe)
    takes_images, image_refusal = sees_images(fe)
    turns = [
        (m.role, m.parts(i, takes_audio=takes_audio, takes_images=takes_images, image_refusal=image_refusal))
        for i, m in enumerate(req.messages)
    ]
    fe.check_text("".join(p for _, ps in turns for p in ps if isinstance(p, str)), "messages")
    stops = _stops(req.stop)
    rid = check_request_id(request.headers.get("x-request-id"), "chatcmpl")
    decoded = await decode_turns(fe, turns)
    sampling = fe.sampling(
        max_tokens=req.max_completion_tokens or req.max_tokens,
        max_tokens_param="max_completion_tokens" if req.max_completion_tokens else "max_tokens",
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
    )
    extras = {"voice": audio[1]} if audio else {}
    stream, prompt = submit_turns(
        fe,
        endpoint="chat",
        turns=decoded,
        modalities=modalities,
        request_id=rid,
        sampling=sampling,
        extras=extras,
        session=req.prompt_cache_key,
        tooling=tools.prompt if tools is not None else None,
        delivery=STREAMED if req.stream else WHOLE,
    )
    fmt = audio[0] if audio else None
    answer = _Answer(
        stream=stream,
        prompts=fe.prompts,
        prompt=prompt,
        stops=StopMatcher(stops),
        audio=AudioEmitter(require_sample_rate=fmt == "wav") if fmt else None,
    )
    headers = {"X-Request-Id": rid}
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return ClosingStreamingResponse(
            _sse(fe, answer, fmt, include_usage, tools),
            on_close=stream.close,
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache"},
        )
    try:
        result = await until_disconnect(request, _complete(fe, answer, fmt, tools))
    except ClientGone:
        return Response(status_code=499)
    finally:
        stream.close()
    return JSONResponse(result, headers=headers)


async def _complete(
    fe: Frontend, answer: _Answer, fmt: str | None, tools: ChatTools | None = None
) -> dict[str, Any]:
    pieces: list[torch.Tensor] = []
    try:
        async for out in answer.stream:
            if out.restarted and not answer.stops.is_stopped:
                # It lost a replica and runs again from the start (a whole answer cut at a
                # stop sequence is already complete: the rest is ignored).
                answer, pieces = answer.fresh(), []
                continue
            answer.last_finish_reason = out.finish_reason or answer.last_finish_reason
            if out.modality == "text":
                answer.text_of(out)
            elif out.modality == "audio" and (got := answer.audio_of(out)) is not None:
                pieces.append(got[0])
    except RequestFailedError as exc:
        raise request_failed(exc) from exc
    except AudioStreamError as exc:
        answer.stream.abort("bad_audio")
        raise ApiError(500, f"the audio could not be sent: {exc}", type="server_error") from exc
    text = "".join(answer.text)
    reason = answer.finish_reason
    content: str | None = text
    calls: list[ToolCall] = []
    if tools is not None:  # the calls come out of the text (and of a spoken answer's transcript)
        content, calls, reason = tools.complete(text, reason)
        text = content or ""
    # With audio, the spoken text is the audio's transcript, and content is null (OpenAI's).
    message: dict[str, Any] = {"role": "assistant", "content": None if fmt else content, "refusal": None}
    if calls:
        message["tool_calls"] = [c.chat() for c in calls]
    if fmt is not None and answer.audio is not None:
        samples = torch.cat(pieces) if pieces else torch.zeros(0)
        rate = answer.audio.sample_rate or answer.audio.default_sample_rate
        encoder = AudioEncoder(AUDIO_FORMATS[fmt], is_streaming=False)
        encoder.push(samples, rate)
        data = encoder.finish(rate)
        message["audio"] = {
            "id": f"audio_{answer.stream.request_id}",
            "data": base64.b64encode(data).decode("ascii"),
            "expires_at": int(time.time()) + AUDIO_TTL_S,
            "transcript": text,
        }
    return {
        "id": answer.stream.request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": fe.model_name,
        "choices": [{"index": 0, "message": message, "finish_reason": reason, "logprobs": None}],
        "usage": answer.usage(),
    }


def _spoken(delta: dict[str, Any], audio_id: str) -> dict[str, Any]:
    """A text delta of a spoken answer: the audio's transcript (OpenAI's); calls as they are."""
    if "content" in delta:
        return {"audio": {"id": audio_id, "transcript": delta["content"]}}
    return delta


def _event(payload: Any) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


async def _sse(
    fe: Frontend, answer: _Answer, fmt: str | None, include_usage: bool, tools: ChatTools | None = None
) -> AsyncIterator[bytes]:
    rid = answer.stream.request_id
    created = int(time.time())
    audio_id = f"audio_{rid}"
    encoder = AudioEncoder(AUDIO_FORMATS[fmt], is_streaming=True) if fmt is not None else None
    calls = tools.stream() if tools is not None else None

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> bytes:
        return _event(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": fe.model_name,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}],
            }
        )

    yield chunk({"role": "assistant", "content": None if encoder else ""})
    try:
        async for out in answer.stream:
            answer.last_finish_reason = out.finish_reason or answer.last_finish_reason
            if out.modality == "text":
                piece = answer.text_of(out)
                deltas = calls.push(piece) if calls is not None else [{"content": piece}] if piece else []
                for delta in deltas:
                    yield chunk(_spoken(delta, audio_id) if encoder is not None else delta)
            elif out.modality == "audio" and (got := answer.audio_of(out)) is not None:
                assert encoder is not None
                data = encoder.push(*got)
                if data:
                    yield chunk({"audio": {"id": audio_id, "data": base64.b64encode(data).decode("ascii")}})
    except (RequestFailedError, AudioStreamError) as exc:
        if isinstance(exc, RequestFailedError):
            yield _event(stream_error_body(exc))
        else:
            answer.stream.abort("bad_audio")
            yield _event(error_body(f"the request failed mid-stream: {exc}", type="server_error"))
        yield b"data: [DONE]\n\n"
        return
    except OmniRelayError as exc:  # pragma: no cover - defensive: a runtime error mid-stream
        yield _event(error_body(f"internal error: {exc}", type="server_error"))
        yield b"data: [DONE]\n\n"
        return
    if encoder is not None and answer.audio is not None:
        tail = encoder.finish(answer.audio.default_sample_rate)
        if tail:
            yield chunk({"audio": {"id": audio_id, "data": base64.b64encode(tail).decode("ascii")}})
        yield chunk({"audio": {"id": audio_id, "expires_at": int(time.time()) + AUDIO_TTL_S}})
    reason = answer.finish_reason
    if calls is not None:
        for delta in calls.finish():
            yield chunk(_spoken(delta, audio_id) if encoder is not None else delta)
        reason = calls.finish_reason(reason)
    yield chunk({}, reason)
    if include_usage:
        yield _event(
            {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": fe.model_name,
                "choices": [],
                "usage": answer.usage(),
            }
        )
    yield b"data: [DONE]\n\n"
