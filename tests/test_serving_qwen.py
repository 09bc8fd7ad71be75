"""The server over the tiny Qwen3-Omni pipeline (Thinker -> Talker -> Code2Wav, real
multi-process path): the official ``openai`` client for chat (text, text + audio,
streaming and not) and speech (wav, pcm, streaming), a ``websockets`` client for the
streaming speech socket, and clients that disconnect after their first audio.

The Thinker decodes greedily and the Talker samples with its config's fixed seed, so
one prompt gives the same text and waveform on every request: streamed audio must equal
non-streamed audio sample for sample (to the rounding of the adaptive chunk schedule's
windows: :func:`~tests.serving_support.assert_same_pcm`). Requests run one at a time
where equality is checked (batching is not part of the claim).
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import pytest
import websockets

from omnirelay.serving import ServerConfig
from omnirelay.serving.media.audio_out import parse_wav
from tests.serving_support import (
    Served,
    assert_same_pcm,
    chat_stream_audio,
    disconnect_after_first_audio,
    serve,
)

MODEL = "qwen3-omni-tiny"
HELLO = [{"role": "user", "content": "Hello, who are you?"}]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(MODEL, ServerConfig())


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


@pytest.fixture(scope="module")
def reference(served: Served) -> dict[str, Any]:
    """One non-streaming text + audio answer (WAV) and one speech WAV, the references."""
    client = served.client()
    r = client.chat.completions.create(
        model=MODEL, messages=HELLO, modalities=["text", "audio"], audio={"voice": "chelsie", "format": "wav"}
    )
    pcm, rate = parse_wav(base64.b64decode(r.choices[0].message.audio.data))
    speech = client.audio.speech.create(
        model=MODEL, voice="ethan", input="Good morning.", response_format="wav"
    )
    speech_pcm, speech_rate = parse_wav(speech.content)
    served.audit()
    return {
        "chat": r,
        "pcm": pcm.tobytes(),
        "rate": rate,
        "speech_pcm": speech_pcm.tobytes(),
        "speech_rate": speech_rate,
    }


def test_chat_text_only(srv: Served) -> None:
    r = srv.client().chat.completions.create(model=MODEL, messages=HELLO, modalities=["text"], max_tokens=8)
    assert r.choices[0].message.content and r.choices[0].message.audio is None
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0


def test_chat_text_and_audio_non_streaming(srv: Served, reference: dict[str, Any]) -> None:
    r = reference["chat"]
    message = r.choices[0].message
    assert message.content is None and message.audio.transcript  # the spoken text, as OpenAI's
    assert message.audio.id == f"audio_{r.id}" and message.audio.expires_at > r.created
    assert reference["rate"] == 24000
    # 64 Talker frames (its max_tokens) at 1,920 samples a frame, less the decoder's tail
    assert 60 * 1920 < len(reference["pcm"]) // 2 <= 64 * 1920


def test_chat_streamed_audio_equals_non_streamed(srv: Served, reference: dict[str, Any]) -> None:
    chunks = srv.client().chat.completions.create(
        model=MODEL,
        messages=HELLO,
        modalities=["text", "audio"],
        audio={"voice": "chelsie", "format": "pcm16"},
        stream=True,
    )
    text, audio, seen = chat_stream_audio(chunks)
    assert text == reference["chat"].choices[0].message.audio.transcript
    assert_same_pcm(audio, reference["pcm"])
    assert (
        sum(1 for c in seen if c.choices and c.choices[0].delta.audio and c.choices[0].delta.audio.data) >= 2
    )


def test_chat_streamed_wav_starts_with_its_header(srv: Served, reference: dict[str, Any]) -> None:
    chunks = srv.client().chat.completions.create(
        model=MODEL,
        messages=HELLO,
        modalities=["audio"],
        audio={"voice": "chelsie", "format": "wav"},
        stream=True,
    )
    text, audio, _ = chat_stream_audio(chunks)
    assert text == ""  # audio only: the Thinker's text is not a requested output
    assert audio[:4] == b"RIFF"
    pcm, rate = parse_wav(audio)
    assert rate == 24000
    assert_same_pcm(pcm.tobytes(), reference["pcm"])


def test_speech_wav_pcm_and_streaming(srv: Served, reference: dict[str, Any]) -> None:
    client = srv.client()
    pcm = client.audio.speech.create(model=MODEL, voice="ethan", input="Good morning.", response_format="pcm")
    assert_same_pcm(pcm.content, reference["speech_pcm"])
    assert reference["speech_rate"] == 24000
    assert pcm.response.headers["x-sample-rate"] == "24000"
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="ethan", input="Good morning.", response_format="pcm", extra_body={"stream": True}
    ) as resp:
        pieces = list(resp.iter_bytes())
    assert_same_pcm(b"".join(pieces), reference["speech_pcm"])
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="ethan", input="Good morning.", response_format="wav", stream_format="audio"
    ) as resp:
        wav = resp.read()
    assert_same_pcm(parse_wav(wav)[0].tobytes(), reference["speech_pcm"])


async def _ws_speech(url: str, config: dict[str, Any], text: str) -> tuple[list[dict[str, Any]], bytes]:
    events: list[dict[str, Any]] = []
    audio = b""
    async with websockets.connect(url) as ws:
        await ws.send(json.dumps({"type": "session.config", **config}))
        await ws.send(json.dumps({"type": "input.text", "text": text}))
        await ws.send(json.dumps({"type": "input.done"}))
        await ws.send(json.dumps({"type": "session.close"}))
        async for m in ws:
            if isinstance(m, bytes):
                audio += m
            else:
                events.append(json.loads(m))
    return events, audio


def test_websocket_streams_the_same_audio(srv: Served, reference: dict[str, Any]) -> None:
    cfg = {"voice": "ethan", "response_format": "pcm", "stream_audio": True}
    events, audio = asyncio.run(_ws_speech(srv.ws_url, cfg, "Good morning."))
    assert_same_pcm(audio, reference["speech_pcm"])
    kinds = [e["type"] for e in events]
    assert kinds == ["audio.start", "audio.done", "session.done"]
    assert events[0]["sample_rate"] == 24000 and events[0]["sentence_text"] == "Good morning."
    assert events[1]["total_bytes"] == len(audio) and events[1]["error"] is None
    events, wav = asyncio.run(
        _ws_speech(srv.ws_url, {"response_format": "wav", "stream_audio": False}, "Good morning.")
    )
    samples, rate = parse_wav(wav)  # one complete WAV frame (voice: the default)
    assert events[0]["sample_rate"] == rate == 24000 and samples.size


def test_clients_gone_after_first_audio_leave_nothing(srv: Served) -> None:
    before = srv.metric("omnirelay_aborts_total", reason="client_disconnect")
    body = {"messages": HELLO, "modalities": ["text", "audio"], "audio": {"format": "pcm16"}, "stream": True}
    assert asyncio.run(disconnect_after_first_audio(srv.url, body, 8)) == 8
    srv.wait_idle()
    assert srv.metric("omnirelay_aborts_total", reason="client_disconnect") - before == 8
    srv.audit()
    r = srv.client().chat.completions.create(model=MODEL, messages=HELLO, modalities=["text"], max_tokens=4)
    assert r.choices[0].message.content


def test_websocket_client_gone_mid_sentence_aborts(srv: Served) -> None:
    before = srv.metric("omnirelay_aborts_total", reason="client_disconnect")

    async def go() -> None:
        async with websockets.connect(srv.ws_url) as ws:
            await ws.send(json.dumps({"type": "session.config", "response_format": "pcm"}))
            await ws.send(json.dumps({"type": "input.text", "text": "Tell me a story."}))
            await ws.send(json.dumps({"type": "input.done"}))
            assert json.loads(await ws.recv())["type"] == "audio.start"
            assert isinstance(await ws.recv(), bytes)  # first audio: leave now

    asyncio.run(go())
    srv.wait_idle()
    assert srv.metric("omnirelay_aborts_total", reason="client_disconnect") - before == 1


def test_metrics_saw_audio(srv: Served) -> None:
    assert srv.metric("omnirelay_time_to_first_audio_seconds_count", endpoint="chat") >= 3
    assert srv.metric("omnirelay_real_time_factor_count", endpoint="speech") >= 2
    # What a listener heard, per stream: its first playable audio, and whether it had a gap.
    model = srv.frontend.model_name
    playable = srv.metric("omnirelay_first_playable_audio_seconds_count", endpoint="chat", model=model)
    streams = sum(
        srv.metric("omnirelay_audio_streams_total", endpoint="chat", model=model, gap_free=flag)
        for flag in ("true", "false")
    )
    assert playable >= 3 and streams == playable
    gaps = srv.metric("omnirelay_audio_gap_seconds_count", endpoint="chat", model=model)
    assert gaps == srv.metric("omnirelay_audio_underruns_total", endpoint="chat", model=model)
    assert srv.metric("omnirelay_failures_total", endpoint="chat") == 0


def test_word_timestamps_need_an_aligner(srv: Served) -> None:
    import httpx

    resp = httpx.post(srv.url + "/v1/audio/speech", json={"input": "hi", "word_timestamps": True})
    assert resp.status_code == 400 and "forced-aligner" in resp.json()["error"]["message"]
