"""Supervision as HTTP and WebSocket clients see it: a stage killed under a streaming
chat ends the stream with an ``error`` event (code ``stage_unavailable``) at once; while
it restarts, requests that need it get 503 with ``Retry-After`` and OpenAI's error body
(not a hang, not a 500), text-only chat is still served, ``/health`` says ``restarting``
with the stage's state and restart count; once it is back, audio is served again.

The restarted stage's engine build is held by a file (:mod:`tests.supervision_fakes`), so
the test decides how long the restart lasts. Ends with the leak audit.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import websockets

from omnirelay.api import Pipeline, RestartPolicy, RuntimeHooks
from omnirelay.serving import ServerConfig, ServerThread, create_app
from tests.orchestrator_audit import audit_running, audit_stopped
from tests.serving_support import sse_events
from tests.supervision_fakes import HOLD_ENV, STALL_TOKENS, kill_stage
from tests.test_orchestrator_process import fake_config

POLICY = RestartPolicy(max_restarts=5, window_s=300, backoff_s=0.05, max_backoff_s=0.2)
CONFIG = ServerConfig(max_concurrency=16, max_tokens_limit=10 * STALL_TOKENS)
AUDIO_CHAT = {
    "model": "scripted-3stage",
    "messages": [{"role": "user", "content": "Hi"}],
    "modalities": ["text", "audio"],
    "audio": {"voice": "chelsie", "format": "pcm16"},
}


@pytest.fixture
def hold(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    path = tmp_path / "hold"
    monkeypatch.setenv(HOLD_ENV, str(path))
    yield path
    path.unlink(missing_ok=True)


def ws_speech_error(url: str) -> list[dict[str, object]]:
    async def run() -> list[dict[str, object]]:
        async with websockets.connect(url) as ws:
            await ws.send(json.dumps({"type": "session.config", "response_format": "pcm"}))
            await ws.send(json.dumps({"type": "input.text", "text": "Hello there."}))
            await ws.send(json.dumps({"type": "input.done"}))
            await ws.send(json.dumps({"type": "session.close"}))
            return [json.loads(m) async for m in ws if isinstance(m, str)]

    return asyncio.run(run())


def test_a_killed_stage_is_503_with_retry_after_until_it_is_back(hold: Path) -> None:
    pipe = Pipeline.start(
        fake_config(),
        runtime=RuntimeHooks(engine_factory="tests.supervision_fakes:build_held_engine"),
        restart=POLICY,
    )
    server = ServerThread(create_app(pipe, CONFIG)).start()
    url = server.base_url
    try:
        with httpx.Client(base_url=url, timeout=30) as http:
            assert http.get("/health").json()["status"] == "healthy"
            hold.touch()  # the restarted Talker stays in its engine build until released
            body = {**AUDIO_CHAT, "stream": True, "max_tokens": STALL_TOKENS}
            with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                assert resp.status_code == 200
                lines = resp.iter_lines()
                for event in sse_events(lines):
                    if event["choices"] and "audio" in event["choices"][0]["delta"]:
                        break  # mid-stream: stage 0 stalls after two tokens
                t0 = time.monotonic()
                kill_stage(pipe, 1)
                rest = list(sse_events(lines))
                took = time.monotonic() - t0
            assert took < 2.0
            assert rest[-1]["error"]["code"] == "stage_unavailable", rest
            assert "stage 1 (talker)" in rest[-1]["error"]["message"]
            assert "killed by SIGKILL" in rest[-1]["error"]["message"]

            for stream in (False, True):  # refused before any stream starts
                resp = http.post(
                    "/v1/chat/completions", json={**AUDIO_CHAT, "stream": stream, "max_tokens": 3}
                )
                assert resp.status_code == 503, resp.text
                assert int(resp.headers["Retry-After"]) >= 1
                err = resp.json()["error"]
                assert err["code"] == "stage_unavailable" and err["type"] == "server_error"
                assert "stage 1 (talker) is restarting" in err["message"]
            speech = http.post(
                "/v1/audio/speech", json={"model": "scripted-3stage", "input": "Hi", "voice": "chelsie"}
            )
            assert speech.status_code == 503 and "Retry-After" in speech.headers
            events = ws_speech_error(server.base_url.replace("http://", "ws://") + "/v1/audio/speech/stream")
            assert [e["code"] for e in events if e["type"] == "error"] == ["stage_unavailable"]

            health = http.get("/health")
            assert health.status_code == 503
            hb = health.json()
            talker = hb["stages"][1]
            assert hb["status"] == "restarting" and talker["state"] in ("restarting", "starting")
            assert talker["last_exit"] == "killed by SIGKILL" and talker["is_alive"] is False
            assert hb["stages"][0]["state"] == "healthy" and hb["stages"][0]["restarts"] == 0

            text = http.post(
                "/v1/chat/completions",
                json={"messages": AUDIO_CHAT["messages"], "modalities": ["text"], "max_tokens": 3},
            )
            assert text.status_code == 200, text.text  # the Thinker alone serves text

            hold.unlink()
            pipe.wait_ready(60)
            hb = http.get("/health").json()
            assert hb["status"] == "healthy" and hb["stages"][1]["state"] == "healthy"
            assert hb["stages"][1]["restarts"] == 1
            metrics = http.get("/metrics").text
            assert 'omnirelay_stage_restarts_total{stage="1:talker"} 1.0' in metrics
            again = http.post("/v1/chat/completions", json={**AUDIO_CHAT, "max_tokens": 3})
            assert again.status_code == 200 and again.json()["choices"][0]["message"]["audio"]["data"]
        deadline = time.monotonic() + 20
        while pipe.num_active and time.monotonic() < deadline:
            time.sleep(0.01)  # responses sent; the pipeline's books follow (a condition)
        audit_running(pipe)
    finally:
        server.stop()
        audit_stopped(pipe)
