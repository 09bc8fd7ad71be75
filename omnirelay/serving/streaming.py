"""Responses that notice a client going away, so its request is aborted at once.

* :class:`ClosingStreamingResponse` — a streaming body raced against the client's
  ``http.disconnect`` (whatever ASGI spec version the server speaks); when either ends,
  the body is closed and ``on_close`` runs (it aborts the request and frees its slot).
  ``on_close`` also runs when the body never started.
* :func:`until_disconnect` — await a coroutine unless the client disconnects first
  (then it is cancelled and :class:`ClientGone` is raised): non-streaming responses.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

__all__ = ["ClientGone", "ClosingStreamingResponse", "until_disconnect"]

T = TypeVar("T")


class ClientGone(Exception):
    """The client disconnected before the response was ready (nobody to answer)."""


async def _wait_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


class ClosingStreamingResponse(StreamingResponse):
    """A :class:`StreamingResponse` that always listens for the client's disconnect and
    always runs ``on_close`` (see the module docstring)."""

    def __init__(self, content: Any, *, on_close: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as tg:

                async def stream() -> None:
                    await self.stream_response(send)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                await _wait_disconnect(receive)
                tg.cancel_scope.cancel()
        except OSError:  # the transport broke mid-send: the client is gone
            pass
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            self._on_close()


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """``await work`` unless the client disconnects first (see the module docstring)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        raise ClientGone()
    finally:
        for fut in (task, watcher):
            if not fut.done():
                fut.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
