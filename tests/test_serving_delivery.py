"""How a route's delivery decides what a lost replica does to its request
(:class:`~omnirelay.serving.frontend.RequestStream`, docs/protocol.md §2.9), with a real
:class:`~omnirelay.orchestrator.handle.RequestHandle` fed by hand: no pipeline.

* a whole answer (``WHOLE``) sees the ``restarted`` output and starts over;
* a response that may run again until its first output (``UNTIL_FIRST``: realtime) runs
  on quietly when the restart comes before the route took anything, and fails with
  ``stage_unavailable`` (the request aborted) when it comes after;
* the handle drops the failed attempt's outputs the consumer had not read, and its
  ``result()`` keeps only what follows the restart.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from omnirelay.errors import StageUnavailableError
from omnirelay.orchestrator.handle import RequestHandle
from omnirelay.orchestrator.requests import RequestOutput
from omnirelay.serving.admission import Slot
from omnirelay.serving.frontend import STREAMED, UNTIL_FIRST, WHOLE, RequestStream
from omnirelay.serving.metrics import ServerMetrics


def text(rid: str, piece: str, *, finished: bool = False) -> RequestOutput:
    return RequestOutput(
        request_id=rid,
        stage_id=0,
        modality="text",
        text=piece,
        token_ids=[1],
        stage_finished=finished,
        finished=finished,
        finish_reason="stop" if finished else None,
    )


def restarted(rid: str) -> RequestOutput:
    return RequestOutput(request_id=rid, stage_id=0, modality="", restarted=True)


class FakePipeline:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def stream_of(handle: RequestHandle, delivery: str) -> tuple[RequestStream, FakePipeline]:
    pipeline = FakePipeline()
    frontend: Any = SimpleNamespace(metrics=ServerMetrics([0.1, 1.0]), pipeline=pipeline)
    return RequestStream(frontend, handle, Slot(lambda: None), "chat", delivery), pipeline


async def read(
    stream: RequestStream, handle: RequestHandle, feed: list[RequestOutput]
) -> list[RequestOutput]:
    """Deliver ``feed`` one output per read (the consumer takes each before the next comes)."""
    got: list[RequestOutput] = []
    it = stream.__aiter__()
    for out in feed:
        handle.deliver(out)
        if out.restarted and stream.delivery != WHOLE:
            continue  # swallowed: the next read gets the output after it
        got.append(await it.__anext__())
    return got


def test_a_whole_answer_sees_the_restart_and_what_follows_it() -> None:
    h = RequestHandle("w")
    stream, pipeline = stream_of(h, WHOLE)
    got = asyncio.run(read(stream, h, [text("w", "old"), restarted("w"), text("w", "new", finished=True)]))
    assert [(o.restarted, o.text) for o in got] == [(False, "old"), (True, None), (False, "new")]
    assert stream.num_restarts == 1 and pipeline.aborted == [] and stream.error is None


def test_until_first_runs_on_quietly_when_the_restart_comes_before_any_output() -> None:
    h = RequestHandle("r")
    stream, pipeline = stream_of(h, UNTIL_FIRST)
    got = asyncio.run(read(stream, h, [restarted("r"), text("r", "hi", finished=True)]))
    assert [o.text for o in got] == ["hi"] and stream.num_restarts == 1 and pipeline.aborted == []


def test_until_first_fails_and_aborts_once_the_route_took_an_output() -> None:
    h = RequestHandle("r")
    stream, pipeline = stream_of(h, UNTIL_FIRST)

    async def go() -> None:
        it = stream.__aiter__()
        h.deliver(text("r", "sent"))
        assert (await it.__anext__()).text == "sent"
        h.deliver(restarted("r"))
        with pytest.raises(StageUnavailableError) as info:
            await it.__anext__()
        assert info.value.retry_after_s == 0.0

    asyncio.run(go())
    assert pipeline.aborted == ["r"] and stream.error is not None and stream.is_done


def test_a_stream_never_gets_a_restart_from_the_router_but_passes_one_on_as_whole_would_not() -> None:
    # STREAMED requests are not buffered: the router never restarts them after an output.
    # Should one come, the stream treats it as UNTIL_FIRST does (fails once it sent).
    h = RequestHandle("s")
    stream, pipeline = stream_of(h, STREAMED)

    async def go() -> None:
        it = stream.__aiter__()
        h.deliver(text("s", "a"))
        await it.__anext__()
        h.deliver(restarted("s"))
        with pytest.raises(StageUnavailableError):
            await it.__anext__()

    asyncio.run(go())
    assert pipeline.aborted == ["s"]


def test_the_handle_drops_the_failed_attempts_unread_outputs_and_result_keeps_the_rerun() -> None:
    h = RequestHandle("h")
    for out in (text("h", "a"), text("h", "b"), restarted("h"), text("h", "c", finished=True)):
        h.deliver(out)
    res = h.result(timeout=1.0)
    assert res.text == "c" and [o.text for o in res.outputs] == ["c"]
    h2 = RequestHandle("h2")
    h2.deliver(text("h2", "a"))
    first = h2.next_output(timeout=1.0)  # the consumer read this one
    h2.deliver(text("h2", "b"))  # unread when the restart comes: dropped
    h2.deliver(restarted("h2"))
    h2.deliver(text("h2", "c", finished=True))
    rest = list(h2)
    assert first.text == "a" and [(o.restarted, o.text) for o in rest] == [(True, None), (False, "c")]
