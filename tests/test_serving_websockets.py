"""WebSocket connections against the server's capacity (``max_websockets``,
:mod:`omnirelay.serving.admission`) over ``toy-3stage`` (no model semantics needed):

* every open ``/v1/audio/speech/stream`` or ``/v1/realtime`` socket holds a connection slot
  for its life, shown in ``/health`` (``num_websockets``) and ``/metrics``;
* with ``N`` open, one more of either kind is told why (an ``error`` with ``server_busy``
  and ``retry_after_s``) and closed with 1013 and a reason before any session starts;
  once one closes, the next is accepted;
* a socket frees its slot however it ends: a normal close, a client that vanishes without
  a close frame (mid-answer), a server error (the session's task dies of a bug: close 1011).

Interleavings are forced by what the server has said (an accepted handshake holds its
slot; a freed slot is waited for as a condition). Every test ends with the leak audit.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from omnirelay.serving import ServerConfig, ServerThread, create_app
from omnirelay.serving.admission import BUSY_CLOSE_REASON
from omnirelay.serving.frontend import Frontend
from omnirelay.serving.text import prompt_side_for
from tests.realtime_support import RealtimeClient
from tests.serving_support import Served, serve

MODEL = "toy-3stage"
LIMIT = 2
CONFIG = ServerConfig(max_concurrency=8, max_websockets=LIMIT, retry_after_s=2)
SPEECH_CONFIG = json.dumps({"type": "session.config", "response_format": "pcm"})


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(MODEL, CONFIG)


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


def speech_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/audio/speech/stream"


def realtime_url(base: str) -> str:
    return base.replace("http://", "ws://") + "/v1/realtime"


async def refused_speech(base: str) -> dict[str, Any]:
    """A speech stream refused at the limit: its one error frame (the close checked)."""
    async with websockets.connect(speech_url(base)) as ws:
        error = json.loads(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed) as info:
            await ws.recv()
    assert info.value.rcvd is not None
    assert (info.value.rcvd.code, info.value.rcvd.reason) == (1013, BUSY_CLOSE_REASON)
    return dict(error)


async def refused_realtime(base: str) -> dict[str, Any]:
    """A realtime session refused at the limit: its one ``error`` event (no
    ``session.created``; the close checked)."""
    async with websockets.connect(realtime_url(base)) as ws:
        event = json.loads(await ws.recv())
        with pytest.raises(websockets.ConnectionClosed) as info:
            await ws.recv()
    assert event["type"] == "error", event
    assert info.value.rcvd is not None
    assert (info.value.rcvd.code, info.value.rcvd.reason) == (1013, BUSY_CLOSE_REASON)
    return dict(event["error"])


def wait_open(fe: Frontend, num_open: int, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while fe.admission.num_websockets != num_open:
        assert time.monotonic() < deadline, f"{fe.admission.num_websockets} WebSockets open, not {num_open}"
        time.sleep(0.01)


def test_one_socket_past_the_limit_is_refused_with_1013_until_one_closes(srv: Served) -> None:
    refused_before = {
        e: srv.metric("omnirelay_websockets_refused_total", endpoint=e) for e in ("speech_ws", "realtime")
    }

    async def go() -> None:
        speech = await websockets.connect(speech_url(srv.url))  # accepted: it holds its slot
        rt = await RealtimeClient.connect(realtime_url(srv.url))  # session.created
        async with httpx.AsyncClient(base_url=srv.url) as http:
            health = (await http.get("/health")).json()
        assert (health["num_websockets"], health["max_websockets"]) == (LIMIT, LIMIT)
        assert srv.metric("omnirelay_websockets_open", endpoint="speech_ws") == 1
        assert srv.metric("omnirelay_websockets_open", endpoint="realtime") == 1
        # One more of either kind: told why, closed with 1013, no session started.
        error = await refused_realtime(srv.url)
        assert error["code"] == "server_busy" and error["type"] == "rate_limit_error"
        assert (
            error["retry_after_s"] == 2 and f"limit of {LIMIT} open WebSocket connections" in error["message"]
        )
        frame = await refused_speech(srv.url)
        assert frame["type"] == "error" and frame["code"] == "server_busy"
        assert frame["status"] == 429 and frame["retry_after_s"] == 2
        assert srv.frontend.admission.num_websockets == LIMIT
        # The open ones are served meanwhile: a sentence is spoken at the limit.
        await speech.send(SPEECH_CONFIG)
        await speech.send(json.dumps({"type": "input.text", "text": "Hi"}))
        await speech.send(json.dumps({"type": "input.done"}))
        assert json.loads(await speech.recv())["type"] == "audio.start"
        # One closes (a normal close): its slot is freed, and the next is accepted.
        await speech.close()
        await asyncio.to_thread(srv.wait_websockets, LIMIT - 1)
        nxt = await RealtimeClient.connect(realtime_url(srv.url))
        assert srv.frontend.admission.num_websockets == LIMIT
        await nxt.close()
        await rt.close()

    asyncio.run(go())
    srv.wait_websockets(0)
    for endpoint, before in refused_before.items():
        assert srv.metric("omnirelay_websockets_refused_total", endpoint=endpoint) == before + 1
        assert srv.metric("omnirelay_websockets_open", endpoint=endpoint) == 0
    assert httpx.get(srv.url + "/health").json()["num_websockets"] == 0


def test_a_client_that_vanishes_mid_answer_frees_its_slot(srv: Served) -> None:
    """Both clients drop their TCP connections without a close frame while an answer is
    being made for them: the requests are aborted and both slots are freed."""

    async def go() -> None:
        speech = await websockets.connect(speech_url(srv.url))
        await speech.send(SPEECH_CONFIG)
        await speech.send(json.dumps({"type": "input.text", "text": "Tell me a long story. " * 20}))
        await speech.send(json.dumps({"type": "input.done"}))
        assert json.loads(await speech.recv())["type"] == "audio.start"
        assert isinstance(await speech.recv(), bytes)  # its audio is being made
        rt = await RealtimeClient.connect(realtime_url(srv.url))
        item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Talk"}]}
        await rt.send({"type": "conversation.item.create", "item": item})
        await rt.send({"type": "response.create", "response": {"max_response_output_tokens": 4000}})
        await rt.until("response.audio.delta")  # its answer is being made
        assert srv.frontend.admission.num_websockets == 2
        for ws in (speech, rt.ws):
            ws.transport.abort()  # gone: no close frame, the TCP connection reset

    asyncio.run(go())
    srv.wait_websockets(0)


class _Bug(Exception):
    """What a bug in the server raises."""


class _BrokenPrompts:
    """The pipeline's prompt side, but making a speech or chat prompt is a bug."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def speech_prompt(self, *args: Any, **kwargs: Any) -> Any:
        raise _Bug("speech_prompt")

    def encode_chat(self, *args: Any, **kwargs: Any) -> Any:
        raise _Bug("encode_chat")


def test_a_server_error_frees_the_slot(served: Served) -> None:
    """A second server over the same pipeline whose prompt side fails: each session ends
    with an ``internal_error`` and close 1011, and frees its slot."""
    app = create_app(served.pipe, CONFIG, prompts=_BrokenPrompts(prompt_side_for(served.pipe)))
    fe = app.state.frontend
    with ServerThread(app) as server:

        async def go() -> tuple[list[Any], list[Any]]:
            async with websockets.connect(speech_url(server.base_url)) as ws:
                for msg in (SPEECH_CONFIG, '{"type": "input.text", "text": "Hi"}', '{"type": "input.done"}'):
                    await ws.send(msg)
                speech = [json.loads(m) async for m in _until_closed(ws)]
                speech.append(ws.close_code)
            rt = await RealtimeClient.connect(realtime_url(server.base_url))
            assert fe.admission.num_websockets == 1
            item = {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}
            await rt.send({"type": "conversation.item.create", "item": item})
            await rt.send({"type": "response.create"})  # its prompt is the bug
            realtime = [json.loads(m) async for m in _until_closed(rt.ws)]
            realtime.append(rt.ws.close_code)
            return speech, realtime

        speech, realtime = asyncio.run(go())
        wait_open(fe, 0)
    assert [e["code"] for e in speech[:-1]] == ["internal_error"] and speech[-1] == 1011
    assert [e["error"]["code"] for e in realtime[:-1] if e["type"] == "error"] == ["internal_error"]
    assert realtime[-1] == 1011
    served.audit()


async def _until_closed(ws: Any) -> Any:
    try:
        async for m in ws:
            yield m
    except websockets.ConnectionClosedError:
        return
