"""The server over a pipeline with stage replicas (``qwen3-omni-tiny-replicas``: two Talker
and two Code2Wav worker processes), with the official ``openai`` client.

Concurrent chat requests with audio are spread over both replicas of each stage and
answer as the one-replica pipeline does; ``/health`` lists every replica; with one
Talker replica killed, ``/health`` reads ``degraded`` (HTTP 200: every stage still
serves), chat with audio still answers on the other replica, and the dead one is
restarted. A Talker or a Code2Wav replica SIGKILLed while it holds about half of the
non-streamed answers in flight (chat with audio, whose text the clients' server already
held; speech WAVs) fails none of them: each runs again on the other replica and answers
exactly as undisturbed. Ends with the leak audit, and after shutdown nothing under
/dev/shm.
"""

from __future__ import annotations

import base64
import functools
import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest

from benchmarks.chaos import ChaosOptions, render_chaos, run_chaos
from omnirelay.pipeline import RestartPolicy, load_pipeline
from omnirelay.pipeline.reproducible import with_reproducible
from omnirelay.serving import ServerConfig
from omnirelay.serving.media.audio_out import parse_wav
from tests.serving_support import Served, serve

MODEL = "qwen3-omni-tiny-replicas"
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def srv() -> Iterator[Served]:
    # The module kills replicas more often than the shipped restart budget allows, and
    # judges answers byte for byte: reproducible mode (docs/usage.md).
    config = msgspec.structs.replace(
        with_reproducible(load_pipeline(MODEL)),
        restart=RestartPolicy(max_restarts=50, backoff_s=0.1, max_backoff_s=1.0),
    )
    yield from serve(config, ServerConfig())


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

    def talker1_pid() -> int | None:
        return next(s.pid for s in srv.pipe.health().stages if (s.stage_id, s.replica) == (1, 1))

    # Until the server says the replica is gone, or it has already come back under a new
    # pid (a restart can fall between two looks); the bound is only for a supervisor that
    # never notices.
    deadline = time.monotonic() + 60
    while (r := httpx.get(srv.url + "/health")).json()["status"] == "healthy" and talker1_pid() == pid:
        assert time.monotonic() < deadline, "the server never noticed the replica's death"
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


# -- a replica killed while it holds whole (non-streamed) answers ----------------------------


def ask_chat(srv: Served, i: int) -> tuple[str, bytes]:
    """A non-streamed spoken chat answer: its transcript and 16-bit PCM."""
    r = srv.client().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
        modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "wav"},
        max_tokens=8,
    )
    audio = r.choices[0].message.audio
    pcm, _ = parse_wav(base64.b64decode(audio.data))
    return audio.transcript, pcm.tobytes()


def ask_speech(srv: Served, i: int) -> tuple[str, bytes]:
    """A non-streamed speech WAV: its 16-bit PCM."""
    r = srv.client().audio.speech.create(
        model=MODEL, voice="ethan", input=f"Number {i}, good morning.", response_format="wav"
    )
    pcm, _ = parse_wav(r.content)
    return "", pcm.tobytes()


def assert_same_answer_audio(got: bytes, want: bytes) -> None:
    """Two renderings of one answer in reproducible mode: the same samples, byte for byte."""
    a, b = np.frombuffer(got, dtype="<i2"), np.frombuffer(want, dtype="<i2")
    assert len(a) == len(b) > 0, (len(a), len(b))
    off = a != b
    assert not off.any(), f"{int(off.sum())} of {len(off)} samples differ, first at {int(np.argmax(off))}"
    assert float(np.abs(b.astype(np.int32)).mean()) > 100  # a real signal, not silence


def held_on(srv: Served, stage_id: int, replica: int) -> int:
    """Requests a replica holds by the front's books (a stopped worker's own reply times out)."""
    stages = srv.pipe.health(timeout_s=0.2).stages
    return next(s.num_requests for s in stages if (s.stage_id, s.replica) == (stage_id, replica))


def kill_while_holding(srv: Served, stage_id: int, asks: list[Any]) -> None:
    """Every request of ``asks`` answers as undisturbed when a replica of ``stage_id`` is
    SIGKILLed holding about half of them, after the Thinker gave each its text: the
    worker is stopped (SIGSTOP) before they come, so the ones bound to it are held there
    for sure, and killed once the others are as far as they can go."""
    srv.pipe.wait_ready(120)
    with ThreadPoolExecutor(len(asks)) as pool:
        want = list(pool.map(lambda a: a(), asks))
    reruns = srv.pipe.health().num_reruns
    victim = 1
    pid = srv.pipe.replica_pids()[(stage_id, victim)]
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        with ThreadPoolExecutor(len(asks)) as pool:
            futures = [pool.submit(a) for a in asks]

            def ready() -> bool:
                health = srv.pipe.health(timeout_s=0.2)
                done = sum(f.done() for f in futures)
                held = next(
                    s.num_requests for s in health.stages if (s.stage_id, s.replica) == (stage_id, victim)
                )
                thinker = next(s.num_requests for s in health.stages if s.stage_id == 0)
                return thinker == 0 and held > 0 and health.num_requests + done == len(asks)

            deadline = time.monotonic() + 60
            while not ready():
                assert time.monotonic() < deadline, "the requests never reached the stopped replica"
                time.sleep(0.05)
            num_held = held_on(srv, stage_id, victim)
            assert num_held >= len(asks) // 4, num_held  # the balancer gave it about half
            os.kill(pid, signal.SIGKILL)
            errors = [f.exception() for f in futures]
            assert errors == [None] * len(asks)
            got = [f.result() for f in futures]
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for (text, pcm), (want_text, want_pcm) in zip(got, want):
        assert text == want_text
        assert_same_answer_audio(pcm, want_pcm)
    assert srv.pipe.health().num_reruns - reruns == num_held
    srv.pipe.wait_ready(120)
    srv.audit()


def test_a_talker_replica_killed_holding_whole_chat_answers_fails_none(srv: Served) -> None:
    kill_while_holding(srv, 1, [functools.partial(ask_chat, srv, i) for i in range(8)])


def test_a_code2wav_replica_killed_holding_whole_answers_fails_none(srv: Served) -> None:
    asks = [functools.partial(ask_speech if i % 2 else ask_chat, srv, i) for i in range(8)]
    kill_while_holding(srv, 2, asks)


def test_a_short_chaos_run_fails_no_client_that_had_nothing(srv: Served) -> None:
    """The chaos benchmark's short form (benchmarks/chaos.py): streamed and whole chat and
    speech while replicas are SIGKILLed at random."""
    srv.pipe.wait_ready(120)
    report = run_chaos(
        srv.url,
        ChaosOptions(
            duration_s=8.0,
            kill_every_s=(2.0, 3.0),
            max_kills=1,
            concurrency=5,
            prompts=1,
            request_timeout_s=120.0,
        ),
    )
    text = render_chaos(report)
    assert report["kills"], text
    assert report["requests"] >= 5, text
    assert report["errors_nothing_received"] == 0, text
    assert report["wrong"] == 0 and report["duplicated"] == 0 and report["hung"] == 0, text
    assert report["health_after"] == "healthy" and report["audit_clean"], text
    srv.audit()
