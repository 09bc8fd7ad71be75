"""The server over a pipeline with stage replicas (``qwen3-omni-tiny-replicas``: two Talker
and two Code2Wav worker processes), with the official ``openai`` client.

Concurrent chat requests with audio are spread over both replicas of each stage and
answer as the one-replica pipeline does; ``/health`` lists every replica; with one
Talker replica killed, ``/health`` reads ``degraded`` (HTTP 200: every stage still
serves), chat with audio still answers on the other replica, and the dead one is
restarted. Ends with the leak audit, and after shutdown nothing under /dev/shm.
"""

from __future__ import annotations

import base64
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from omnirelay.serving import ServerConfig
from omnirelay.serving.media.audio_out import parse_wav
from tests.serving_support import Served, serve

MODEL = "qwen3-omni-tiny-replicas"
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def srv() -> Iterator[Served]:
    yield from serve(MODEL, ServerConfig())


def chat_audio(srv: Served, content: str) -> tuple[str, int]:
    r = srv.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "wav"},
        max_tokens=8,
    )
    audio = r.choices[0].message.audio
    pcm, rate = parse_wav(base64.b64decode(audio.data))
    assert rate == 24000 and len(pcm) > 0
    return audio.transcript, len(pcm)


def test_concurrent_chat_with_audio_is_served_by_both_replicas(srv: Served) -> None:
    health = httpx.get(srv.url + "/health").json()
    assert health["status"] == "healthy"
    assert [(s["stage_id"], s["replica"], s["replicas"]) for s in health["stages"]] == [
        (0, 0, 1),
        (1, 0, 2),
        (1, 1, 2),
        (2, 0, 2),
        (2, 1, 2),
    ]
    prompts = [f"Say something about the number {i}." for i in range(4)]
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda p: chat_audio(srv, p), prompts))
    assert all(text for text, _ in answers)
    srv.audit()
    served = {(s.stage_id, s.replica): (s.engine or {}).get("num_added") for s in srv.pipe.health().stages}
    assert len(served) == 5
    metrics = httpx.get(srv.url + "/metrics").text  # one series per replica, none twice
    for label in ("0:thinker", "1:talker#0", "1:talker#1", "2:code2wav#0", "2:code2wav#1"):
        assert f'omnirelay_stage_up{{stage="{label}"}} 1.0' in metrics
    assert metrics.count('omnirelay_edge_pending_keys{edge="1 -> 2"}') <= 1  # (absent while none pend)


def test_a_conversation_with_a_prompt_cache_key_stays_on_one_replica(srv: Served) -> None:
    def given() -> dict[int, int]:
        stages = srv.pipe.health().stages
        return {s.replica: int((s.engine or {}).get("num_added", 0)) for s in stages if s.stage_id == 1}

    before = given()
    for turn in range(3):
        r = srv.client().chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Turn {turn}."}],
            modalities=["text", "audio"],
            audio={"voice": "chelsie", "format": "wav"},
            max_tokens=4,
            prompt_cache_key="conversation-42",
        )
        assert r.choices[0].message.audio.data
    after = given()
    assert sorted(after[k] - before[k] for k in after) == [0, 3]  # every turn on one replica
    srv.audit()


def test_one_talker_replica_down_the_server_is_degraded_and_still_speaks(srv: Served) -> None:
    pid = srv.pipe.replica_pids()[(1, 1)]
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while (r := httpx.get(srv.url + "/health")).json()["status"] == "healthy":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    body = r.json()
    if body["status"] == "degraded":  # (it may be back already on a fast machine)
        assert r.status_code == 200
        talker1 = next(s for s in body["stages"] if (s["stage_id"], s["replica"]) == (1, 1))
        assert talker1["state"] in ("restarting", "starting")
    text, samples = chat_audio(srv, "Are you still there?")
    assert text and samples > 0
    srv.pipe.wait_ready(120)
    talker1 = next(s for s in srv.pipe.health().stages if (s.stage_id, s.replica) == (1, 1))
    assert talker1.num_restarts == 1 and talker1.pid != pid
    srv.audit()
