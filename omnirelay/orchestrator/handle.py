"""The client's end of one request: :class:`RequestHandle` and :class:`RequestResult`.

The orchestrator thread delivers :class:`RequestOutput` s into a handle; one consumer
reads them from any thread, synchronously (``for out in handle``) or from any event
loop (``async for out in handle``). The last output has ``finished=True``:

* a normal end (``finish_reason`` "stop" / "length" …) is yielded, then iteration stops;
* an abort (``finish_reason == "abort"``) is yielded, then iteration stops;
* a failure (``finish_reason == "error"``) raises :class:`RequestFailedError` with the
  reason (which names the stage) instead of being yielded —
  :class:`~omnirelay.errors.StageUnavailableError` when a stage it needs is down.

A request submitted ``buffered`` (its consumer keeps the whole answer) runs again from the
start when it loses a replica, even after outputs came: the iterator then yields a
``restarted`` output, and whatever came before it is the failed attempt's, to be dropped
(outputs of that attempt not read yet are dropped here).

:meth:`RequestHandle.result` / :meth:`RequestHandle.result_async` read everything and
return a :class:`RequestResult` (text token ids, text, the waveform concatenated); after
a ``restarted`` output they keep only what follows it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from omnirelay.errors import PipelineError, RequestFailedError, StageUnavailableError
from omnirelay.orchestrator.requests import RequestOutput

__all__ = ["RequestHandle", "RequestResult"]


@dataclass
class RequestResult:
    """Every output of one request, with the per-modality views tests and tools want."""

    request_id: str
    outputs: list[RequestOutput] = field(default_factory=list)

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[-1].finish_reason if self.outputs else None

    @property
    def is_aborted(self) -> bool:
        return self.finish_reason == "abort"

    def token_ids(self, modality: str = "text") -> list[int]:
        """Token ids of the outputs of ``modality`` (stage order kept), concatenated."""
        return [t for o in self.outputs if o.modality == modality for t in o.token_ids]

    @property
    def text(self) -> str:
        return "".join(o.text or "" for o in self.outputs if o.modality == "text")

    @property
    def audio(self) -> torch.Tensor | None:
        """The waveform: every audio piece concatenated (None when no audio came)."""
        pieces = [
            torch.as_tensor(o.audio).reshape(-1)
            for o in self.outputs
            if o.modality == "audio" and o.audio is not None
        ]
        return torch.cat(pieces) if pieces else None

    @property
    def sample_rate(self) -> int | None:
        rates = [o.sample_rate for o in self.outputs if o.modality == "audio" and o.sample_rate]
        return rates[-1] if rates else None


class RequestHandle:
    """Outputs of one request as they stream; one consumer; see the module docstring."""

    def __init__(
        self,
        request_id: str,
        *,
        abort: Callable[[str], None] | None = None,
        on_done: Callable[[str], None] | None = None,
        is_held: bool = False,
    ) -> None:
        """``on_done(request_id)``: called once when the request's id is free again — when
        its terminal output is delivered, or, for a handle ``is_held``, when that has
        happened and :meth:`close` was called too (a server whose response outlives the
        pipeline's last output keeps the id taken until the response is sent)."""
        self.request_id = request_id
        self._abort = abort
        self._on_done = on_done
        self._is_held = is_held
        self._is_closed = False
        self._is_done_reported = False
        self._cond = threading.Condition(threading.Lock())
        self._items: deque[RequestOutput] = deque()
        self._async_waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._is_end_claimed = False  # deliver took a terminal output (producer side)
        self._is_delivered = False  # the terminal output is there for the consumer
        self._is_exhausted = False  # the consumer read the terminal output

    # -- producer side (orchestrator thread) ----------------------------------------------

    def deliver(self, output: RequestOutput) -> None:
        """Hand one output to the consumer; called by the orchestrator only."""
        with self._cond:
            if self._is_end_claimed:
                return  # nothing follows the terminal output
            is_done = output.finished and (not self._is_held or self._is_closed)
            if output.finished:
                self._is_end_claimed = True  # a second end is dropped above
                self._is_done_reported = is_done
        if is_done and self._on_done is not None:
            # Before the consumer can see the end: a client that reads the last output and
            # at once submits a new request under the same id must find the id free. Only
            # for the first end: a late second one would free the id of that new request.
            self._on_done(self.request_id)
        with self._cond:
            if output.restarted:  # what the failed attempt left unread is void
                self._items.clear()
            self._items.append(output)
            if output.finished:
                self._is_delivered = True
            waiters, self._async_waiters = self._async_waiters, []
            self._cond.notify_all()
        for loop, fut in waiters:
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:  # the consumer's loop is closed: nobody is waiting any more
                pass

    # -- consumer side ----------------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        """True once the request ended (the terminal output arrived; it may be unread)."""
        with self._cond:
            return self._is_delivered

    def close(self) -> None:
        """The consumer is done with this handle (idempotent). A held handle's id is free
        once this and the terminal output both happened."""
        with self._cond:
            if self._is_closed:
                return
            self._is_closed = True
            is_done = self._is_end_claimed and not self._is_done_reported
            self._is_done_reported = self._is_done_reported or is_done
        if is_done and self._on_done is not None:
            self._on_done(self.request_id)

    def abort(self) -> None:
        """Abort the request (no-op once it ended)."""
        if self._abort is None:
            raise PipelineError("this handle is not attached to a pipeline")
        self._abort(self.request_id)

    def _take(self) -> RequestOutput | None:
        # Caller holds the lock. None: nothing yet. Raises StopIteration at the end.
        if self._items:
            out = self._items.popleft()
            if out.finished:
                self._is_exhausted = True
                if out.finish_reason == "error":
                    reason = out.error or "unknown error"
                    if out.error_code == StageUnavailableError.code:
                        raise StageUnavailableError(self.request_id, reason, retry_after_s=out.retry_after_s)
                    raise RequestFailedError(self.request_id, reason)
            return out
        if self._is_exhausted:
            raise StopIteration
        return None

    def next_output(self, timeout: float | None = None) -> RequestOutput:
        """Block for the next output. StopIteration at the end; TimeoutError on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                out = self._take()
                if out is not None:
                    return out
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"no output of request {self.request_id!r} within {timeout} s")
                self._cond.wait(remaining)

    def __iter__(self) -> Iterator[RequestOutput]:
        return self

    def __next__(self) -> RequestOutput:
        return self.next_output()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self

    async def __anext__(self) -> RequestOutput:
        loop = asyncio.get_running_loop()
        # One turn of the event loop per output, even when it is already here: a consumer
        # that fell behind would otherwise take output after output without ever suspending
        # (a streaming response's send does not suspend while its socket is writable, or
        # gone), and nothing else on its loop — its cancellation when the client went
        # away, a disconnect, the other streams — would run until the backlog was drained.
        await asyncio.sleep(0)
        while True:
            with self._cond:
                try:
                    out = self._take()
                except StopIteration:
                    raise StopAsyncIteration from None
                if out is not None:
                    return out
                fut: asyncio.Future[None] = loop.create_future()
                self._async_waiters.append((loop, fut))
            await fut

    def result(self, timeout: float | None = None) -> RequestResult:
        """Read every remaining output (blocking); raises RequestFailedError on failure."""
        res = RequestResult(self.request_id)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                out = self.next_output(remaining)
            except StopIteration:
                return res
            _collect(res, out)

    async def result_async(self) -> RequestResult:
        """Read every remaining output; raises RequestFailedError on failure."""
        res = RequestResult(self.request_id)
        async for out in self:
            _collect(res, out)
        return res

    def __repr__(self) -> str:
        return f"RequestHandle({self.request_id!r}, finished={self.is_finished})"


def _collect(res: RequestResult, out: RequestOutput) -> None:
    if out.restarted:
        res.outputs.clear()  # the failed attempt's; the request runs again from the start
    else:
        res.outputs.append(out)


def _wake(fut: asyncio.Future[Any]) -> None:
    if not fut.done():
        fut.set_result(None)
