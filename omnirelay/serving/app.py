"""The OpenAI-compatible app: :func:`create_app` over a started :class:`~omnirelay.api.Pipeline`.

======================================  =================================================
route                                   serves
======================================  =================================================
``POST /v1/chat/completions``           :mod:`omnirelay.serving.routes.chat`
``POST /v1/audio/speech``               :mod:`omnirelay.serving.routes.speech`
``POST /v1/audio/transcriptions``       :mod:`omnirelay.serving.routes.transcriptions`
                                        (a pipeline with a speech recognizer stage)
``WS /v1/audio/speech/stream``          :mod:`omnirelay.serving.routes.speech_stream`
``WS /v1/realtime``                     :mod:`omnirelay.serving.realtime.session`
``GET /``                               the browser page (``ui`` on only:
                                        :mod:`omnirelay.serving.realtime.ui`)
``GET /v1/models``                      the one model (the pipeline)
``GET /v1/models/{id}``                 that model, or 404 ``model_not_found``
``GET /health``                         per stage, from ``pipeline.health_async()``:
                                        state (starting, healthy, restarting, failed),
                                        restarts, last exit; 503 unless all healthy;
                                        the admission books: requests in flight and
                                        open WebSockets against their limits;
                                        ``?audit=1`` adds the leak audit
                                        (:mod:`omnirelay.serving.audit`)
``GET /metrics``                        Prometheus text (:mod:`omnirelay.serving.metrics`)
======================================  =================================================

The app does not own the pipeline: whoever started it shuts it down (the ``serve``
command, a test fixture). Each WebSocket holds a connection slot of the admission gate
while it is open (:mod:`omnirelay.serving.admission`); past ``max_websockets`` a new one
is told why and closed with 1013 before its session starts. Every error leaves as OpenAI's JSON error body with a 4xx/5xx
and a string ``code`` (``not_found``, ``method_not_allowed`` …). API keys, browser
origins and CORS are checked before routing (:mod:`omnirelay.serving.security`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, WebSocket
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from omnirelay.api import Pipeline, PipelineHealth
from omnirelay.errors import OmniRelayError, StageUnavailableError
from omnirelay.models.family import PromptSide
from omnirelay.serving.admission import AdmissionGate
from omnirelay.serving.audit import leak_audit
from omnirelay.serving.errors import ApiError, error_body, translate
from omnirelay.serving.frontend import Frontend
from omnirelay.serving.metrics import CONTENT_TYPE, ServerMetrics, live_bytes
from omnirelay.serving.openapi import error_responses, json_operation
from omnirelay.serving.protocol import ChatCompletionRequest, SpeechRequest
from omnirelay.serving.realtime import session as realtime
from omnirelay.serving.realtime import ui
from omnirelay.serving.routes import chat, speech, speech_stream, transcriptions
from omnirelay.serving.security import SecurityMiddleware
from omnirelay.serving.server_config import ServerConfig
from omnirelay.serving.text import prompt_side_for

__all__ = ["create_app"]

logger = logging.getLogger(__name__)

_ENDPOINTS = {
    "/v1/chat/completions": "chat",
    "/v1/audio/speech": "speech",
    "/v1/audio/transcriptions": "transcriptions",
}
#: OpenAI-style ``code`` of the errors the router itself raises (status in the status line)
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
_CHAT_OK = {
    "description": "a chat.completion, or with stream: true server-sent chat.completion.chunk events",
    "content": {"application/json": {"schema": {"type": "object"}}, "text/event-stream": {}},
}
_SPEECH_OK = {
    "description": "the audio (streamed as it is made with stream or stream_format)",
    "content": {"audio/wav": {}, "audio/pcm": {}, "text/event-stream": {}},
}


_TRANSCRIPTION_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "required": ["file"],
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "model": {"type": "string"},
                    "response_format": {"type": "string", "enum": list(transcriptions.RESPONSE_FORMATS)},
                    "timestamp_granularities[]": {
                        "type": "array",
                        "items": {"type": "string", "enum": ["segment", "word"]},
                    },
                    "language": {"type": "string"},
                    "temperature": {"type": "number"},
                },
            }
        }
    },
}
_TRANSCRIPTION_OK = {
    "description": "the transcript: JSON (json, verbose_json) or text (text, srt, vtt)",
    "content": {"application/json": {"schema": {"type": "object"}}, "text/plain": {}},
}


def create_app(
    pipeline: Pipeline,
    config: ServerConfig | None = None,
    *,
    prompts: PromptSide | None = None,
    admission: AdmissionGate | None = None,
    metrics: ServerMetrics | None = None,
) -> FastAPI:
    """The app serving ``pipeline``. ``prompts`` (default: the pipeline's prompt side),
    ``admission`` and ``metrics`` are injectable (tests hold slots, read counters; an
    injected gate's limits are the server's, in place of ``config``'s)."""
    cfg = config or ServerConfig()
    fe = Frontend(pipeline, cfg, prompts or prompt_side_for(pipeline), admission=admission, metrics=metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        probe = asyncio.create_task(_probe_live_bytes(fe)) if cfg.max_live_bytes is not None else None
        try:
            yield
        finally:
            if probe is not None:
                probe.cancel()
                await asyncio.gather(probe, return_exceptions=True)

    app = FastAPI(title="omnirelay", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.frontend = fe
    app.add_middleware(SecurityMiddleware, config=cfg)

    _install_error_handlers(app, fe)

    @app.post(
        "/v1/chat/completions", openapi_extra=json_operation(ChatCompletionRequest, _CHAT_OK, fe.model_name)
    )
    async def _chat(request: Request) -> Response:
        return await chat.chat_completions(request, fe)

    @app.post("/v1/audio/speech", openapi_extra=json_operation(SpeechRequest, _SPEECH_OK, fe.model_name))
    async def _speech(request: Request) -> Response:
        return await speech.speech(request, fe)

    @app.post(
        "/v1/audio/transcriptions",
        openapi_extra={"requestBody": _TRANSCRIPTION_BODY, "responses": {"200": _TRANSCRIPTION_OK}},
    )
    async def _transcriptions(request: Request) -> Response:
        return await transcriptions.transcriptions(request, fe)

    @app.websocket(speech.WS_PATH)
    async def _speech_stream(ws: WebSocket) -> None:
        await speech_stream.serve_session(ws, fe)

    @app.websocket(realtime.REALTIME_PATH)
    async def _realtime(ws: WebSocket) -> None:
        await realtime.serve_realtime(ws, fe)

    if cfg.ui:

        @app.get("/", include_in_schema=False)
        async def _page() -> Response:
            return ui.page_response()

    _install_status_routes(app, fe, pipeline)
    return app


def _install_status_routes(app: FastAPI, fe: Frontend, pipeline: Pipeline) -> None:
    """``/v1/models``, ``/health`` (with ``?audit=1``: the leak audit) and ``/metrics``."""

    @app.get("/v1/models", responses=error_responses("401", "403"))
    async def _models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(fe)]}

    @app.get("/v1/models/{model_id:path}", responses=error_responses("401", "403", "404"))
    async def _model(model_id: str) -> dict[str, Any]:
        fe.check_model(model_id)
        return _model_card(fe)

    @app.get("/health")
    async def _health(request: Request) -> JSONResponse:
        try:
            health = await pipeline.health_async()
        except OmniRelayError as exc:
            return JSONResponse({"status": "unhealthy", "error": str(exc), "stages": []}, status_code=503)
        fe.metrics.update_health(health)
        fe.admission.live_bytes = live_bytes(health)
        body = _health_body(fe, health)
        if request.query_params.get("audit") in ("1", "true"):
            body["audit"] = await leak_audit(pipeline, fe.admission.num_active)
        return JSONResponse(body, status_code=200 if health.is_serving else 503)

    @app.get("/metrics")
    async def _metrics() -> Response:
        try:
            health = await pipeline.health_async()
        except OmniRelayError:
            health = None
        if health is not None:
            fe.metrics.update_health(health)
            fe.admission.live_bytes = live_bytes(health)
        return Response(fe.metrics.render(), media_type=CONTENT_TYPE)


def _install_error_handlers(app: FastAPI, fe: Frontend) -> None:
    """Every error becomes an OpenAI-style JSON body; API errors are counted per endpoint."""

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        endpoint = _ENDPOINTS.get(request.url.path)
        if endpoint is not None:
            outcome = "rejected" if exc.status == 429 else ("invalid" if exc.status < 500 else "failed")
            fe.metrics.requests.labels(endpoint, outcome).inc()
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(
            error_body(str(exc.detail), code=_HTTP_CODES.get(exc.status_code, "invalid_request_error")),
            status_code=exc.status_code,
            headers=exc.headers,
        )

    @app.exception_handler(OmniRelayError)
    async def _runtime_error(request: Request, exc: OmniRelayError) -> JSONResponse:
        if isinstance(exc, StageUnavailableError):  # a stage is down: 503, not a server bug
            err = translate(exc)
            return JSONResponse(err.body(), status_code=err.status, headers=err.headers)
        logger.error("unhandled omnirelay error on %s: %s", request.url.path, exc)
        return JSONResponse(
            error_body(f"internal error: {exc}", type="server_error", code="internal_error"), status_code=500
        )

    @app.exception_handler(Exception)
    async def _bug(request: Request, exc: Exception) -> JSONResponse:
        # A bug: still OpenAI's JSON error (not a plain-text 500); the server logs the traceback.
        return JSONResponse(
            error_body(f"internal error: {type(exc).__name__}", type="server_error", code="internal_error"),
            status_code=500,
        )


def _model_card(fe: Frontend) -> dict[str, Any]:
    return {"id": fe.model_name, "object": "model", "created": fe.created, "owned_by": "omnirelay"}


def _health_body(fe: Frontend, health: PipelineHealth) -> dict[str, Any]:
    """``GET /health``'s body: the server's admission books and every stage's state."""
    stages = []
    by_pid: dict[int, list[int]] = {}
    for st in health.stages:
        if st.pid is not None and st.is_alive:
            by_pid.setdefault(st.pid, []).append(st.stage_id)
    for st in health.stages:
        engine = st.engine or {}
        stages.append(
            {
                "stage_id": st.stage_id,
                "name": st.name,
                "replica": st.replica,
                "replicas": st.replicas,
                "is_alive": st.is_alive,
                "pid": st.pid,
                # the other stages of its worker process (a device group, docs/design.md §12)
                "shares_process_with": [
                    sid for sid in by_pid.get(st.pid or -1, []) if sid != st.stage_id and st.is_alive
                ],
                "status": engine.get("status", "unknown" if st.is_alive else "dead"),
                "num_requests": st.num_requests,
                "queue_depth": st.queue_depth,
                "error": st.error,
                "state": st.state,
                "restarts": st.num_restarts,
                "last_exit": st.last_exit,
                "retry_after_s": st.retry_after_s,
            }
        )
    return {
        "status": health.status,
        # the pipeline started (before, the server's startup board answers, docs/protocol.md §7.6)
        "ready": True,
        "model": fe.model_name,
        "namespace": health.namespace,
        "num_requests": health.num_requests,
        "num_reruns": health.num_reruns,
        "num_in_flight": fe.admission.num_active,
        "max_concurrency": fe.admission.max_concurrency,
        # open WebSockets (speech streams and realtime sessions), each a connection slot
        "num_websockets": fe.admission.num_websockets,
        "max_websockets": fe.admission.max_websockets,
        "live_bytes": fe.admission.live_bytes,
        "audio_streams": dict(health.audio_streams),
        "stages": stages,
    }


async def _probe_live_bytes(fe: Frontend, interval_s: float = 1.0) -> None:
    """Keep admission's view of live transfer bytes fresh (only with a byte budget)."""
    while True:
        try:
            health = await fe.pipeline.health_async()
        except OmniRelayError:
            pass
        else:
            fe.admission.live_bytes = live_bytes(health)
        await asyncio.sleep(interval_s)
