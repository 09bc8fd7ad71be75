"""The server while its pipeline starts: :class:`StartupBoard` and :class:`LateApp`.

``omnirelay serve`` binds its port and serves at once; preparing models and starting the
stage workers takes seconds. Meanwhile :class:`LateApp` answers every request itself:

* ``GET /health`` — 503 ``{"status": "starting", "step": …, "elapsed_s": …, "stages":
  [{stage_id, name, state: "starting" | "ready"}, …]}`` (``"failed"`` with the reason
  when the start failed);
* anything else — 503 ``starting`` (OpenAI's error body) with ``Retry-After``; a WebSocket
  is refused the same way.

Once the pipeline is up, :meth:`LateApp.ready` hands every request to the real app
(:func:`~omnirelay.serving.app.create_app`), whose ``/health`` says ``ready``. The real
app's lifespan (its background probe) runs from then until the server stops.

:class:`StartupBoard` is the books the start writes (from its own thread) and ``/health``
reads: the current step and each stage's state, under a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnirelay.pipeline import PipelineConfig
from omnirelay.serving.errors import error_body

__all__ = ["LateApp", "StartupBoard"]

#: the Retry-After of a request that arrives while the pipeline starts
RETRY_AFTER_S = 2


class StartupBoard:
    """What the start has done so far (written by the starting thread, read by ``/health``)."""

    def __init__(self, pipeline: PipelineConfig) -> None:
        self._lock = threading.Lock()
        self._t0 = time.monotonic()
        self._stages = {s.id: (s.name, "starting") for s in pipeline.stages}
        self._step = "loading the runtime (the model families, torch)"
        self._failure: str | None = None

    def step(self, label: str) -> None:
        with self._lock:
            self._step = label

    def stage_ready(self, stage_id: int) -> None:
        with self._lock:
            name, _ = self._stages[stage_id]
            self._stages[stage_id] = (name, "ready")

    def fail(self, reason: str) -> None:
        with self._lock:
            self._failure = reason

    def body(self) -> dict[str, Any]:
        with self._lock:
            return {
                "status": "failed" if self._failure is not None else "starting",
                "ready": False,
                "step": self._step,
                "error": self._failure,
                "elapsed_s": round(time.monotonic() - self._t0, 3),
                "stages": [
                    {"stage_id": sid, "name": name, "state": state}
                    for sid, (name, state) in self._stages.items()
                ],
            }


class LateApp:
    """An ASGI app that answers for the real one until :meth:`ready` (see the module docstring)."""

    def __init__(self, board: StartupBoard, on_startup: Callable[[], None] | None = None) -> None:
        self.board = board
        #: called once the server's lifespan starts (it listens right after): the start of
        #: the pipeline begins then, so its imports do not delay the first answers
        self._on_startup = on_startup
        self._app: ASGIApp | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._inner_lifespan: asyncio.Task[None] | None = None
        self._inner_events: asyncio.Queue[Message] | None = None
        self._inner_started: asyncio.Future[None] | None = None

    def ready(self, app: ASGIApp) -> None:
        """Serve ``app`` from now on (any thread): its lifespan starts on the server's loop,
        and requests go to it from the next one that arrives there."""
        loop = self._loop
        if loop is None:  # the server has not started: it hands over at its startup
            self._app = app
            return
        with contextlib.suppress(RuntimeError):  # the server has stopped: nothing to serve
            loop.call_soon_threadsafe(self._start_inner_lifespan, app)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        app = self._app
        if app is not None:
            await app(scope, receive, send)
            return
        if scope["type"] == "http" and scope["path"] == "/health":
            await _json(send, 503, self.board.body())
            return
        body = error_body(
            f"the server is starting ({self.board.body()['step']}); retry in {RETRY_AFTER_S} s",
            type="server_error",
            code="starting",
        )
        if scope["type"] == "http":
            await _json(send, 503, body, retry_after=True)
        elif scope["type"] == "websocket":
            await receive()  # websocket.connect
            if "websocket.http.response" in scope.get("extensions", {}):
                raw = json.dumps(body).encode()
                headers = [
                    (b"content-type", b"application/json"),
                    (b"retry-after", str(RETRY_AFTER_S).encode()),
                ]
                await send({"type": "websocket.http.response.start", "status": 503, "headers": headers})
                await send({"type": "websocket.http.response.body", "body": raw})
            else:
                await send({"type": "websocket.close", "code": 1013})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        """The server's lifespan: startup at once; at shutdown, the real app's too."""
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self._loop = asyncio.get_running_loop()
                if self._app is not None:  # made ready before the server started
                    app, self._app = self._app, None
                    self._start_inner_lifespan(app)
                await send({"type": "lifespan.startup.complete"})
                if self._on_startup is not None:
                    self._on_startup()
            elif message["type"] == "lifespan.shutdown":
                await self._stop_inner_lifespan()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _start_inner_lifespan(self, app: ASGIApp) -> None:
        """Run ``app``'s lifespan protocol on this loop, then route requests to it."""
        events: asyncio.Queue[Message] = asyncio.Queue()
        started: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        async def inner_send(message: Message) -> None:
            if message["type"].startswith("lifespan.startup") and not started.done():
                started.set_result(None)

        events.put_nowait({"type": "lifespan.startup"})
        self._inner_events, self._inner_started = events, started

        async def run() -> None:
            scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
            await app(scope, events.get, inner_send)

        self._inner_lifespan = asyncio.create_task(run())
        self._app = app

    async def _stop_inner_lifespan(self) -> None:
        task, events = self._inner_lifespan, self._inner_events
        if task is None or events is None:
            return
        events.put_nowait({"type": "lifespan.shutdown"})
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 10.0)


async def _json(send: Send, status: int, body: dict[str, Any], *, retry_after: bool = False) -> None:
    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    if retry_after:
        headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})
