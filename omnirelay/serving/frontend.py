"""What every endpoint shares: :class:`Frontend` (checks, sampling, submit) and
:class:`RequestStream` (one admitted request's outputs, metrics and its end).

A request's life on the server::

    slot = admission.acquire()                  # 429 when over the limits
    stream = frontend.submit(...)               # the pipeline starts it (never blocks)
    async for out in stream: ...                # RequestOutput s; failures raise
    stream.close()                              # always (finally): aborts it through every
                                                # stage when it has not ended, frees the slot

A WebSocket holds a connection slot (:meth:`Frontend.open_websocket`) while it is open;
each response it asks for is a request as above.

``close`` is synchronous and idempotent, so a cancelled task (a client that went away)
can call it from its ``finally``. :meth:`RequestStream.abort` records why.

How the route hands the outputs to its client (``submit``'s ``delivery``) decides what
losing a replica does to a request (docs/protocol.md §2.9): :data:`STREAMED` — each as it
comes; the request runs again only while the pipeline had produced nothing for it.
:data:`WHOLE` — the answer at its end (a non-streamed response): the request runs again
however far it got, and the stream yields a ``restarted`` output after which the route
starts its answer over. :data:`UNTIL_FIRST` — each as it comes, but the request runs again
until the route took its first output (a realtime response before its first event); a
loss after that fails it with ``stage_unavailable``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import msgspec

from omnirelay.api import Pipeline, RequestOutput, SamplingParams, stage_sampling_defaults
from omnirelay.errors import OmniRelayError, RequestFailedError, StageUnavailableError
from omnirelay.models.family import PromptSide
from omnirelay.serving.admission import AdmissionGate, Slot
from omnirelay.serving.errors import ApiError, translate
from omnirelay.serving.metrics import ServerMetrics
from omnirelay.serving.server_config import ServerConfig, openai_voice_map
from omnirelay.timeline.playback import playback_of

__all__ = [
    "CHAT_MODALITIES",
    "STOP_SEQUENCE",
    "STREAMED",
    "UNTIL_FIRST",
    "WHOLE",
    "Frontend",
    "RequestStream",
]

CHAT_MODALITIES = ("text", "audio")
#: the abort reason of a request ended early by one of its stop sequences (not a failure)
STOP_SEQUENCE = "stop_sequence"
#: how a route hands a request's outputs to its client (see the module docstring)
STREAMED = "streamed"
WHOLE = "whole"
UNTIL_FIRST = "until_first"
DELIVERIES = (STREAMED, WHOLE, UNTIL_FIRST)


class RequestStream:
    """One admitted request: iterate its outputs once; always :meth:`close` it."""

    def __init__(
        self, frontend: Frontend, handle: Any, slot: Slot, endpoint: str, delivery: str = STREAMED
    ) -> None:
        self.frontend = frontend
        self.handle = handle
        self.request_id: str = handle.request_id
        self.endpoint = endpoint
        self.delivery = delivery
        self._num_taken = 0  # outputs the route took (of the attempt running now)
        #: how often the request started over after losing a replica
        self.num_restarts = 0
        self._slot = slot
        self.t_submit = time.perf_counter()
        self.t_first_token: float | None = None
        self.t_first_audio: float | None = None
        self.num_audio_samples = 0
        self.sample_rate: int | None = None
        #: (seconds since the submit, seconds of audio) of every audio send, for the playback figures
        self._audio_sends: list[tuple[float, float]] = []
        self.finish_reason: str | None = None
        self.abort_reason: str | None = None
        self.error: str | None = None
        self.is_done = False  # the terminal output arrived (or the request failed)
        self._is_closed = False
        frontend.metrics.in_flight.inc()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            async for out in self.handle:
                if out.restarted:
                    self._restart()
                    if self.delivery == WHOLE:
                        yield out  # the route drops the answer it had and starts over
                    continue
                self._num_taken += 1
                self._observe(out)
                yield out
        except RequestFailedError as exc:
            self.is_done = True
            self.error = exc.reason
            self.frontend.metrics.failures.labels(self.endpoint).inc()
            raise

    def _restart(self) -> None:
        """The request lost a replica and runs again from the start."""
        self.num_restarts += 1
        if self.delivery != WHOLE and self._num_taken:
            # The client has part of the answer: the rerun cannot be resumed for it.
            self.frontend.pipeline.abort(self.request_id)
            raise StageUnavailableError(
                self.request_id,
                "a replica serving this request died after part of its answer was sent",
                retry_after_s=0.0,
            )
        self._num_taken = 0
        self.num_audio_samples = 0
        self._audio_sends.clear()

    def _observe(self, out: RequestOutput) -> None:
        now = time.perf_counter()
        if out.token_ids and out.modality == "text" and self.t_first_token is None:
            self.t_first_token = now
            self.frontend.metrics.ttft.labels(self.endpoint).observe(now - self.t_submit)
        if out.stage_finished and "e2e_s" in out.metrics:
            self.frontend.metrics.stage_e2e.labels(str(out.stage_id)).observe(out.metrics["e2e_s"])
        if out.finished:
            self.is_done = True
            self.finish_reason = out.finish_reason

    def note_audio_sent(self, num_samples: int, sample_rate: int) -> None:
        """The server sent ``num_samples`` new samples (time to first audio, RTF)."""
        if num_samples <= 0:
            return
        now = time.perf_counter()
        if self.t_first_audio is None:
            self.t_first_audio = now
            self.frontend.metrics.ttfa.labels(self.endpoint).observe(self.t_first_audio - self.t_submit)
        self.num_audio_samples += num_samples
        self.sample_rate = sample_rate
        self._audio_sends.append((now - self.t_submit, num_samples / sample_rate if sample_rate > 0 else 0.0))

    def abort(self, reason: str) -> None:
        """Abort the request through every stage (no-op once it ended)."""
        if self.is_done or self.abort_reason is not None:
            return
        self.abort_reason = reason
        self.frontend.metrics.aborts.labels(reason).inc()
        self.frontend.pipeline.abort(self.request_id)

    def close(self) -> None:
        """End the request's life on the server; aborts it when it has not ended."""
        if self._is_closed:
            return
        self._is_closed = True
        if not self.is_done:
            self.abort("client_disconnect")
        self._slot.release()
        self.handle.close()  # the id is free once the pipeline is done with it too
        m = self.frontend.metrics
        m.in_flight.dec()
        if self.error is not None:
            outcome = "failed"
        elif self.abort_reason not in (None, STOP_SEQUENCE) or (
            self.abort_reason is None and self.finish_reason == "abort"
        ):
            outcome = "aborted"
        else:
            outcome = "ok"
        m.requests.labels(self.endpoint, outcome).inc()
        if self._audio_sends:
            m.observe_playback(self.endpoint, self.frontend.model_name, playback_of(self._audio_sends))
        if outcome == "ok" and self.num_audio_samples and self.sample_rate:
            audio_s = self.num_audio_samples / self.sample_rate
            m.rtf.labels(self.endpoint).observe((time.perf_counter() - self.t_submit) / audio_s)


class Frontend:
    """The pipeline as the endpoints see it: model name, modalities, voices, sampling."""

    def __init__(
        self,
        pipeline: Pipeline,
        config: ServerConfig,
        prompts: PromptSide,
        *,
        admission: AdmissionGate | None = None,
        metrics: ServerMetrics | None = None,
    ) -> None:
        self.pipeline = pipeline
        self.config = config
        #: the prompt stage's prompt side (chat and speech prompts, media, detokenizing)
        self.prompts = prompts
        self.admission = admission or AdmissionGate(
            config.max_concurrency,
            max_live_bytes=config.max_live_bytes,
            retry_after_s=config.retry_after_s,
            max_websockets=config.max_websockets,
        )
        self.metrics = metrics or ServerMetrics(config.latency_buckets_s)
        self.model_name = config.model_name or pipeline.config.name
        self.created = int(time.time())
        pcfg = pipeline.config
        self.output_types: tuple[str, ...] = tuple(
            dict.fromkeys(
                str(s.final_output_type) for s in pcfg.stages if s.final_output and s.final_output_type
            )
        )
        self._voices = {v.lower(): v for v in config.voices}
        self._openai_voices = openai_voice_map(pcfg.openai_voices, config.voices, pcfg.source)

    # -- checks -------------------------------------------------------------------------

    @property
    def has_aligner(self) -> bool:
        return "timestamps" in self.output_types

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ApiError(
                404,
                f"the model {model!r} does not exist on this server; it serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_voice(self, voice: str | None) -> str:
        """The pipeline voice a client's ``voice`` names: one of its own, or an OpenAI name
        the pipeline file maps to one; else a 400 that lists both."""
        if voice is None:
            return self.config.default_voice.lower()
        key = voice.lower()
        if key in self._voices:
            return key
        if key in self._openai_voices:
            return self._openai_voices[key]
        mapped = f"; OpenAI names it maps: {sorted(self._openai_voices)}" if self._openai_voices else ""
        raise ApiError(
            400, f"unknown voice {voice!r}; supported voices: {sorted(self._voices)}{mapped}", param="voice"
        )

    def chat_modalities(self, value: Any) -> tuple[str, ...]:
        """docs/protocol.md §7.1: absent → the pipeline file's ``default_modalities``, else text
        only (OpenAI's default; a pipeline without text output: what it has); given → a list
        of strings within the pipeline's outputs, or a 400 that lists the supported ones."""
        supported = [m for m in self.output_types if m in CHAT_MODALITIES]
        if value is None:
            default = self.pipeline.config.default_modalities
            if default:
                return tuple(default)
            return ("text",) if "text" in supported else tuple(supported)
        if not isinstance(value, list) or not value or not all(isinstance(m, str) for m in value):
            raise ApiError(
                400,
                f"modalities must be a non-empty list of strings; supported modalities: {supported}",
                param="modalities",
            )
        unknown = [m for m in value if m not in supported]
        if unknown:
            raise ApiError(
                400,
                f"unsupported modalities {unknown}; model {self.model_name!r} supports {supported}",
                param="modalities",
            )
        return tuple(dict.fromkeys(value))

    def check_text(self, text: str, what: str) -> None:
        if len(text) > self.config.max_input_chars:
            raise ApiError(
                400,
                f"{what} is {len(text)} characters long; the limit is {self.config.max_input_chars}",
                param=what,
                code="input_too_long",
            )

    def sampling(
        self,
        *,
        max_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        max_tokens_param: str = "max_tokens",
    ) -> SamplingParams | None:
        """The prompt stage's parameters: the client's values over the stage config's defaults.
        ``max_tokens_param``: the field the client named ``max_tokens`` in (its errors say it)."""
        if max_tokens is not None and max_tokens > self.config.max_tokens_limit:
            raise ApiError(
                400,
                f"{max_tokens_param} is {max_tokens}; the limit is {self.config.max_tokens_limit}",
                param=max_tokens_param,
            )
        given = {
            k: v
            for k, v in (
                ("max_tokens", max_tokens),
                ("temperature", temperature),
                ("top_p", top_p),
                ("seed", seed),
            )
            if v is not None
        }
        if not given:
            return None
        base = stage_sampling_defaults(self.pipeline.config.stages[self.pipeline.config.prompt_stage_id])
        return msgspec.structs.replace(base, **given)

    # -- requests ------------------------------------------------------------------------

    def submit(
        self,
        *,
        endpoint: str,
        prompt_token_ids: Sequence[int],
        modalities: Sequence[str],
        request_id: str,
        sampling: SamplingParams | None = None,
        extras: dict[str, Any] | None = None,
        inputs: Any = None,
        entry_stage_id: int | None = None,
        session: str | None = None,
        delivery: str = STREAMED,
    ) -> RequestStream:
        """Admit and start one request; 429 / 409 / 400 / 503 as :class:`ApiError`.
        ``inputs``: the entry stage's full input (a speech request's, see
        :meth:`submit_speech`; audio clips, :mod:`omnirelay.serving.media.chat_turns`);
        ``entry_stage_id``: where it enters (None: the prompt stage); ``session``: the
        conversation it belongs to (a replicated stage keeps one conversation on one
        replica where its load allows); ``delivery``: how the route hands the outputs to
        its client (:data:`STREAMED`, :data:`WHOLE`, :data:`UNTIL_FIRST`)."""
        if delivery not in DELIVERIES:
            raise ValueError(f"delivery must be one of {DELIVERIES}, got {delivery!r}")
        # A client id stays taken until its response is sent, even when the pipeline is
        # already done with it: the pipeline holds it until the stream closes the handle.
        if self.pipeline.is_in_flight(request_id):  # before a slot is taken: 409, not 429
            raise ApiError(
                409,
                f"request id {request_id!r} is already in flight; wait for its response to end "
                "or use another X-Request-Id",
                param="X-Request-Id",
                code="request_id_in_use",
            )
        slot = self.admission.acquire()
        busy = self.pipeline.capacity_problem(modalities)
        if busy is not None:  # past its real-time capacity the server refuses, not queues
            slot.release()
            self.admission.refuse()
            retry = self.admission.retry_after_s
            raise ApiError(
                429,
                f"{busy}; retry after {retry} s",
                type="rate_limit_error",
                code="audio_capacity",
                headers={"Retry-After": str(retry)},
            )
        try:
            handle = self.pipeline.submit(
                list(prompt_token_ids),
                modalities=list(modalities),
                sampling=sampling,
                request_id=request_id,
                inputs=inputs,
                extras=extras,
                entry_stage_id=entry_stage_id,
                hold_id=True,
                session=session,
                buffered=delivery != STREAMED,
            )
        except OmniRelayError as exc:
            slot.release()
            raise translate(exc) from exc
        except BaseException:
            slot.release()
            raise
        return RequestStream(self, handle, slot, endpoint, delivery)

    def open_websocket(self, endpoint: str) -> Slot:
        """A connection slot for one WebSocket of ``endpoint`` (``speech_ws``,
        ``realtime``), held until the socket closes: release it in the route's ``finally``.
        Over ``max_websockets``: :class:`ApiError` 429 ``server_busy``, counted."""
        try:
            slot = self.admission.open_websocket()
        except ApiError:
            self.metrics.websockets_refused.labels(endpoint).inc()
            raise
        gauge = self.metrics.websockets.labels(endpoint)
        gauge.inc()

        def close() -> None:
            slot.release()
            gauge.dec()

        return Slot(close)

    def check_speech_options(
        self, voice: str, instructions: str | None, language: str | None
    ) -> tuple[str | None, str | None]:
        """A speech request's ``instructions`` and ``language`` as the prompt side takes them
        (blank instructions are none): a 400 when ``voice`` cannot follow instructions
        (:meth:`~omnirelay.models.family.PromptSide.instructions_refusal`) or the model is
        not told that language."""
        if instructions is not None and not instructions.strip():
            instructions = None
        if instructions is not None:
            refusal = self.prompts.instructions_refusal(voice)
            if refusal is not None:
                raise ApiError(
                    400,
                    f"instructions: {refusal}; omit them",
                    param="instructions",
                    code="instructions_not_supported",
                )
            self.check_text(instructions, "instructions")
        if language is not None:
            languages = self.prompts.languages
            if not languages:
                raise ApiError(
                    400, f"model {self.model_name!r} is told no language; drop it", param="language"
                )
            if language.lower() not in languages:
                raise ApiError(
                    400, f"unsupported language {language!r}; supported: {list(languages)}", param="language"
                )
            language = language.lower()
        return instructions, language

    def submit_speech(
        self,
        *,
        endpoint: str,
        text: str,
        modalities: Sequence[str],
        request_id: str,
        extras: dict[str, Any],
        voice: str | None = None,
        instructions: str | None = None,
        language: str | None = None,
        delivery: str = STREAMED,
    ) -> RequestStream:
        """A speech request for ``text`` in ``voice`` (checked: :meth:`check_voice`,
        :meth:`check_speech_options`): the prompt side's prompt, full input and answer
        length (:class:`~omnirelay.models.family.SpeechPrompt`), then :meth:`submit`."""
        try:
            prompt = self.prompts.speech_prompt(
                text, voice=voice, instructions=instructions, language=language
            )
        except ValueError as exc:
            raise ApiError(400, str(exc), param="input") from exc
        sampling = None
        if prompt.max_tokens is not None:
            base = stage_sampling_defaults(self.pipeline.config.stages[self.pipeline.config.prompt_stage_id])
            sampling = msgspec.structs.replace(base, max_tokens=prompt.max_tokens)
        return self.submit(
            endpoint=endpoint,
            prompt_token_ids=prompt.prompt_token_ids,
            modalities=modalities,
            request_id=request_id,
            sampling=sampling,
            extras=extras,
            inputs=prompt.inputs,
            delivery=delivery,
        )
