"""``WS /v1/realtime`` over the default ``voice-cpu`` pipeline (real models and processes)
and its browser page: a spoken answer to a typed question; a spoken question from a WAV
(the pipeline's own voice asking it) whose VAD events fall within 100 ms of its speech
edges, heard by the recognizer stage and answered; barge-in 300 ms into an answer
(``response.done`` cancelled within 100 ms of ``speech_started``, no audio of it after,
nothing of it left in any stage); and the page at ``/`` in headless Chromium whose fake
microphone asks the question. Every test ends with a leak audit.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import wave
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from omnirelay.cli.serve import DEFAULT_PIPELINE, server_config
from omnirelay.pipeline import load_pipeline
from tests.cdp import chromium
from tests.realtime_support import RealtimeClient, append_events, noise, pcm16, pcm_of, utterance
from tests.serving_support import Served, serve

RATE = 24000  # pcm16 on the Realtime API (and pcm from the speech endpoint), as OpenAI's


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(DEFAULT_PIPELINE, server_config(load_pipeline(DEFAULT_PIPELINE), ui=True))


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


def rt_url(srv: Served) -> str:
    return srv.url.replace("http://", "ws://") + "/v1/realtime"


QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def question(served: Served) -> tuple[np.ndarray, float, float]:
    """The question spoken by the pipeline's voice, between 0.8 s and 1.2 s of background
    noise; with its speech edges in seconds (the first and last 10 ms frame over -40 dBFS)."""
    resp = httpx.post(
        served.url + "/v1/audio/speech", json={"input": QUESTION, "response_format": "pcm"}, timeout=120
    )
    assert resp.status_code == 200
    served.audit()
    clip = np.frombuffer(resp.content, "<i2").astype(np.float32) / 32767
    frames = clip[: clip.size // 220 * 220].reshape(-1, 220)
    loud = np.flatnonzero(np.sqrt(np.mean(frames**2, axis=1)) > 0.01)
    lead = 0.8
    signal = np.concatenate(
        [
            noise(RATE, lead),
            clip + noise(RATE, clip.size / RATE, seed=2)[: clip.size],
            noise(RATE, 1.2, seed=3),
        ]
    )
    return signal, lead + loud[0] * 220 / RATE, lead + (loud[-1] + 1) * 220 / RATE


def test_a_text_turn_gets_a_spoken_answer(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        assert c.of("session.created")[0]["session"]["sample_rate"] == RATE
        done = await c.text_turn("What is the capital of France?", {"max_response_output_tokens": 24})
        assert done["response"]["status"] in ("completed", "incomplete")
        transcript = c.of("response.audio_transcript.done")[0]["transcript"]
        assert "Paris" in transcript
        audio = pcm_of([r.event for r in c.events], done["response"]["id"])
        assert len(audio) // 2 > RATE // 2  # more than half a second of speech
        await c.close()

    asyncio.run(go())


def test_a_spoken_question_is_heard_and_answered(
    srv: Served, question: tuple[np.ndarray, float, float], tmp_path: Path
) -> None:
    signal, start_s, end_s = question
    path = tmp_path / "question.wav"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm16(signal))
    with wave.open(str(path), "rb") as w:
        samples = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32767

    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        await c.send({"type": "session.update", "session": {"max_response_output_tokens": 24}})
        await c.until("session.updated")
        for event in append_events(samples, RATE):
            await c.send(event)
        started = await c.until("input_audio_buffer.speech_started")
        stopped = await c.until("input_audio_buffer.speech_stopped")
        assert abs(started["audio_start_ms"] + 300 - start_s * 1000) <= 100, (started, start_s)
        assert abs(stopped["audio_end_ms"] - 500 - end_s * 1000) <= 100, (stopped, end_s)
        await c.until("input_audio_buffer.committed")
        done = await c.until("response.done")
        assert done["response"]["status"] in ("completed", "incomplete")
        deltas = "".join(e["delta"] for e in c.of("response.audio_transcript.delta"))
        assert "Paris" in deltas, deltas
        assert len(pcm_of([r.event for r in c.events], done["response"]["id"])) // 2 > RATE // 2
        await c.close()

    asyncio.run(go())


def test_barge_in_cancels_the_answer_in_every_stage(srv: Served) -> None:
    async def go() -> None:
        c = await RealtimeClient.connect(rt_url(srv))
        # Short answers, but for the one spoken over: the turn that cuts it is answered too.
        await c.send({"type": "session.update", "session": {"max_response_output_tokens": 12}})
        await c.until("session.updated")
        item = {
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "Tell me about the moon in three sentences."}],
        }
        await c.send({"type": "conversation.item.create", "item": item})
        await c.send({"type": "response.create", "response": {"max_response_output_tokens": 256}})
        # 300 ms into the answer (audio received), the user speaks over it.
        heard = 0
        while heard < 0.3 * RATE:
            delta = await c.until("response.audio.delta")
            heard += len(pcm_of([delta], delta["response_id"])) // 2
        cut_id = delta["response_id"]
        for event in append_events(utterance(RATE, 0.2, 0.6, 0.0), RATE):
            await c.send(event)
        started = await c.until("input_audio_buffer.speech_started")
        done = await c.until("response.done")
        mark = len(c.events)
        assert done["response"]["id"] == cut_id and done["response"]["status"] == "cancelled"
        assert c.at(done) - c.at(started) < 0.1, c.at(done) - c.at(started)
        # The conversation keeps the answer as far as it went.
        said = done["response"]["output"][0]
        assert said["status"] == "incomplete" and said["content"][0]["transcript"]
        # The speech ends: its turn is committed and answered (briefly).
        for event in append_events(noise(RATE, 0.8), RATE):
            await c.send(event)
        await c.until("input_audio_buffer.speech_stopped")
        await c.until("input_audio_buffer.committed")
        await c.until("response.done")
        srv.wait_idle()  # the cancelled request ended in the pipeline
        await c.send({"type": "session.update", "session": {}})
        await c.until("session.updated")
        late = [r.event["type"] for r in c.events[mark:] if r.event.get("response_id") == cut_id]
        assert late == [], late
        audit = httpx.get(srv.url + "/health?audit=1").json()["audit"]
        assert audit["clean"], audit
        # Nothing inherited: the next answer starts clean and completes.
        nxt = await c.text_turn("Thank you.", {"max_response_output_tokens": 12})
        assert nxt["response"]["status"] in ("completed", "incomplete")
        await c.close()

    asyncio.run(go())


def test_the_browser_page_talks_and_plays_the_answer(
    srv: Served, question: tuple[np.ndarray, float, float], tmp_path: Path
) -> None:
    """The page at / in headless Chromium: the fake microphone asks the spoken question
    once; the server's VAD takes the turn, the pipeline hears and answers it, the page
    plays the answer. The screenshot and the audio length are kept when
    OMNIRELAY_UI_ARTIFACTS names a directory."""
    capture = tmp_path / "mic.wav"
    with wave.open(str(capture), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm16(question[0]))

    async def go() -> tuple[float, Path]:
        async with chromium(capture, srv.url + "/") as page:
            await page.evaluate("document.getElementById('start').click()", gesture=True)
            await page.wait_for("omnirelayUI.state === 'listening'", 20)
            await page.wait_for("omnirelayUI.events.includes('input_audio_buffer.committed')", 30)
            await page.wait_for("omnirelayUI.responses >= 1", 60)
            state = await page.evaluate("omnirelayUI")
            shot = tmp_path / "realtime-page.png"
            await page.screenshot(shot)
            text = await page.evaluate("document.getElementById('transcript').innerText")
        assert state["sentSamples"] > RATE and not state["errors"], state
        assert "Paris" in text, text
        return state["receivedSamples"] / state["sessionRate"], shot

    seconds, shot = asyncio.run(go())
    assert seconds > 0.5 and shot.stat().st_size > 10_000
    keep = os.environ.get("OMNIRELAY_UI_ARTIFACTS")
    if keep:
        shutil.copy(shot, Path(keep) / shot.name)
        (Path(keep) / "received-audio-seconds.txt").write_text(f"{seconds:.3f}\n")
