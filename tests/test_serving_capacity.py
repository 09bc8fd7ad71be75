"""The server at its real-time capacity (``max_audio_streams: 1`` on ``toy-3stage``): one more
request for audio gets 429 with ``Retry-After`` (code ``audio_capacity``), text is still
served, ``/health`` shows the gate, and the next request for audio is served once the
stream ended. Every test ends with a leak audit."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import msgspec
import pytest

from omnirelay.engine.interfaces import SamplingParams
from omnirelay.pipeline import load_pipeline
from omnirelay.serving import ServerConfig
from tests.serving_support import Served, serve

MODEL = "toy-3stage"
#: A stream long enough to be in flight while the server is asked for another.
LONG = 5_000


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    config = msgspec.structs.replace(load_pipeline(MODEL), max_audio_streams=1)
    yield from serve(config, ServerConfig(retry_after_s=3))


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


def test_one_stream_too_many_is_a_429_and_text_is_still_served(srv: Served) -> None:
    playing = srv.pipe.submit([7], modalities=["audio"], sampling=SamplingParams(max_tokens=LONG))
    next(o for o in playing if o.audio is not None and o.audio.numel())  # it plays, and holds the stream
    speech = httpx.post(
        srv.url + "/v1/audio/speech",
        json={"model": MODEL, "input": "Hi", "response_format": "pcm"},
        timeout=30,
    )
    assert speech.status_code == 429, speech.text
    assert speech.headers["retry-after"] == "3"
    error = speech.json()["error"]
    assert error["code"] == "audio_capacity" and "real-time capacity of 1 audio streams" in error["message"]
    health = httpx.get(srv.url + "/health", timeout=10).json()["audio_streams"]
    assert health["max_audio_streams"] == 1 and health["num_audio_streams"] == 1
    chat = httpx.post(
        srv.url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "modalities": ["text"]},
        timeout=30,
    )
    assert chat.status_code == 200, chat.text  # text takes no stream
    playing.abort()
    assert playing.result(30).finish_reason == "abort"
    again = httpx.post(
        srv.url + "/v1/audio/speech",
        json={"model": MODEL, "input": "Hi", "response_format": "pcm"},
        timeout=30,
    )
    assert again.status_code == 200 and len(again.content) > 0
