"""Shared pieces of the serving tests: a live server over a started pipeline, clients,
the drain wait and the leak audit."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np
import openai

from omnirelay.api import Pipeline
from omnirelay.models import PromptSide
from omnirelay.pipeline import PipelineConfig
from omnirelay.serving import AdmissionGate, ServerConfig, ServerThread, create_app
from omnirelay.serving.frontend import Frontend
from tests.orchestrator_audit import audit_running, audit_stopped


@dataclass
class Served:
    pipe: Pipeline
    server: ServerThread
    frontend: Frontend
    #: Clients handed out, closed at teardown (an unclosed pool's sockets warn at a random GC).
    clients: list[openai.OpenAI] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.server.base_url

    @property
    def ws_url(self) -> str:
        return self.server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream"

    @property
    def model(self) -> str:
        return self.frontend.model_name

    def client(self) -> openai.OpenAI:
        client = openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        self.clients.append(client)
        return client

    def wait_idle(self, timeout_s: float = 20.0) -> None:
        """Until no request is in flight in the server or the pipeline (a condition, not a nap)."""
        deadline = time.monotonic() + timeout_s
        while self.frontend.admission.num_active or self.pipe.num_active:
            assert time.monotonic() < deadline, (
                f"still in flight after {timeout_s} s: server {self.frontend.admission.num_active}, "
                f"pipeline {self.pipe.num_active}"
            )
            time.sleep(0.01)

    def wait_websockets(self, num_open: int = 0, timeout_s: float = 20.0) -> None:
        """Until exactly ``num_open`` WebSockets hold a connection slot (a socket's route
        frees its slot when its session has ended, a moment after the client saw the close)."""
        deadline = time.monotonic() + timeout_s
        while (n := self.frontend.admission.num_websockets) != num_open:
            assert time.monotonic() < deadline, f"{n} WebSockets open after {timeout_s} s, not {num_open}"
            time.sleep(0.01)

    def audit(self) -> None:
        """Nothing in flight, no WebSocket open, nothing left in the pipeline."""
        self.wait_idle()
        self.wait_websockets(0)
        audit_running(self.pipe)

    def metric(self, name: str, **labels: str) -> float:
        """One sample of the server's registry (0 when absent)."""
        value = self.frontend.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else float(value)


def assert_same_pcm(got: bytes, want: bytes) -> None:
    """Two 16-bit PCM renderings of one answer: the same samples, each exactly once.

    The adaptive chunk schedule cuts a stream's decode windows where its timing says, and
    every window is decoded with its full left context, so two requests for the same
    answer agree to float rounding: a sample may differ by one step (1 LSB) after
    quantization; the count and the order of samples may not."""
    a, b = np.frombuffer(got, dtype="<i2"), np.frombuffer(want, dtype="<i2")
    assert len(got) == len(want) and a.shape == b.shape, (len(got), len(want))
    diff = np.abs(a.astype(np.int32) - b.astype(np.int32))
    assert int(diff.max(initial=0)) <= 1, f"{int((diff > 1).sum())} samples differ by more than 1 LSB"
    assert float(np.abs(b.astype(np.int32)).mean()) > 100  # a real signal, not silence


def serve(
    pipeline: str | PipelineConfig,
    config: ServerConfig,
    admission: AdmissionGate | None = None,
    prompts: PromptSide | None = None,
) -> Iterator[Served]:
    """A module fixture's body: start the pipeline and a server (``prompts``: another prompt
    side than the pipeline's); stop both; audit."""
    pipe = Pipeline.start(pipeline)
    try:
        app = create_app(pipe, config, admission=admission, prompts=prompts)
        server = ServerThread(app).start()
        served = Served(pipe, server, app.state.frontend)
        try:
            yield served
        finally:
            for client in served.clients:
                client.close()
            server.stop()
    finally:
        audit_stopped(pipe)


def sse_events(lines: Iterator[str]) -> Iterator[Any]:
    """JSON payloads of ``data:`` lines up to ``[DONE]``."""
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        yield json.loads(data)


def chat_stream_audio(chunks: Any) -> tuple[str, bytes, list[Any]]:
    """Text (``delta.content``, or a spoken answer's ``delta.audio.transcript``), audio
    bytes and chunks of an ``openai`` chat stream."""
    text, audio, seen = "", b"", []
    for chunk in chunks:
        seen.append(chunk)
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        if delta.content:
            text += delta.content
        if delta.audio is not None and getattr(delta.audio, "transcript", None):
            text += delta.audio.transcript  # a spoken answer's text (OpenAI's)
        if delta.audio is not None and getattr(delta.audio, "data", None):
            audio += base64.b64decode(delta.audio.data)
    return text, audio, seen


async def disconnect_after_first_audio(url: str, body: dict[str, Any], n: int) -> int:
    """``n`` concurrent streaming chat clients, each gone right after its first audio
    delta; returns how many saw audio."""

    async def one(client: httpx.AsyncClient) -> bool:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if '"audio":{' in line and '"data"' in line:
                    return True  # leaving the block closes the connection mid-stream
        return False

    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=60, limits=limits) as client:
        results = await asyncio.gather(*(one(client) for _ in range(n)))
    return sum(results)
