"""The server over ``qwen3-tts-aligner-tiny`` (Talker in text mode -> Code2Wav, chunked ->
forced aligner on the complete waveform; real multi-process path): speech with word
timestamps over HTTP and the WebSocket, streaming speech, the ``openai`` client, and the
Talker's text mode (:class:`~omnirelay.models.qwen3_omni.talker.TextConditioner`) on its own.

The Talker samples with its config's fixed seed, so one input gives the same waveform on
every request: the WebSocket's audio must equal the HTTP endpoint's, sample for sample.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from omnirelay.models.qwen3_omni.prompt import QwenPromptSide
from omnirelay.serving import ServerConfig
from omnirelay.serving.media.audio_out import parse_wav
from tests.serving_support import Served, assert_same_pcm, serve

MODEL = "qwen3-tts-aligner-tiny"
SPEECH = "/v1/audio/speech"
TEXT = "Hello big, wide world."


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(MODEL, ServerConfig())


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


@pytest.fixture(scope="module")
def reference(served: Served) -> bytes:
    """The PCM of one non-streaming request for TEXT without timestamps."""
    resp = httpx.post(
        served.url + SPEECH, json={"model": MODEL, "input": TEXT, "response_format": "pcm"}, timeout=120
    )
    assert resp.status_code == 200 and "x-word-timestamps" not in resp.headers and resp.content
    served.audit()
    return resp.content


def _check_words(stamps: object, text: str, duration_ms: float) -> None:
    assert isinstance(stamps, list)
    assert [w["word"] for w in stamps] == text.replace(",", "").replace(".", "").split()
    ends = 0
    for w in stamps:
        assert ends <= w["start_ms"] <= w["end_ms"] <= duration_ms  # monotonic, within the audio
        ends = w["end_ms"]


def test_speech_wav_with_word_timestamps(srv: Served, reference: bytes) -> None:
    resp = httpx.post(
        srv.url + SPEECH,
        json={"model": MODEL, "input": TEXT, "response_format": "wav", "word_timestamps": True},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    pcm, rate = parse_wav(resp.content)
    assert rate == 24000 and len(pcm) > 0
    _check_words(json.loads(resp.headers["x-word-timestamps"]), TEXT, len(pcm) / rate * 1000)
    assert_same_pcm(pcm.tobytes(), reference)  # the same audio as without timestamps


def test_speech_openai_client_streaming_pcm(srv: Served, reference: bytes) -> None:
    client = srv.client()
    with client.audio.speech.with_streaming_response.create(
        model=MODEL, voice="ethan", input=TEXT, response_format="pcm", extra_body={"stream": True}
    ) as resp:
        streamed = resp.read()
    assert_same_pcm(streamed, reference)


async def _ws(url: str, text: str) -> list[Any]:
    cfg = {"type": "session.config", "response_format": "pcm", "stream_audio": True, "word_timestamps": True}
    out: list[Any] = []
    async with websockets.connect(url) as ws:
        for msg in (cfg, {"type": "input.text", "text": text}, {"type": "input.done"}):
            await ws.send(json.dumps(msg))
        await ws.send(json.dumps({"type": "session.close"}))
        async for m in ws:
            out.append(m)
    return out


def test_websocket_word_timestamps(srv: Served, reference: bytes) -> None:
    got = asyncio.run(_ws(srv.ws_url, TEXT))
    events = [json.loads(m) for m in got if isinstance(m, str)]
    assert events[0]["type"] == "audio.start" and events[0]["word_timestamps"] is True
    chunks = [e for e in events if e["type"] == "audio.chunk"]
    *body, trailer = chunks
    assert body and all(c["timestamps"] is None for c in body)
    audio = b"".join(base64.b64decode(str(c["audio_b64"])) for c in chunks)
    assert trailer["audio_b64"] == ""
    duration_ms = len(audio) / 2 / 24000 * 1000
    _check_words(trailer["timestamps"], TEXT, duration_ms)
    assert_same_pcm(audio, reference)  # each sample exactly once: the HTTP endpoint's audio
    done = [e for e in events if e["type"] == "audio.done"]
    assert done[0]["total_bytes"] == len(audio) and done[0]["error"] is None
    assert events[-1]["type"] == "session.done"


# ------------------------------------------------------------------- text mode on its own


def test_text_conditioner_speaks_the_user_turn() -> None:
    from omnirelay.errors import ModelError
    from omnirelay.models.qwen3_omni import load_tokenizer
    from omnirelay.models.qwen3_omni.loader import ModelArgs, open_checkpoint
    from omnirelay.models.qwen3_omni.talker import TalkerSpec, TextConditioner

    checkpoint = open_checkpoint(ModelArgs(tiny=True))
    spec = TalkerSpec.from_config(checkpoint.config)
    cond = TextConditioner.from_checkpoint(checkpoint, spec)
    tok = load_tokenizer(tiny=True)
    prompt = QwenPromptSide(tok).encode_speech("Good morning.")
    spoken = cond.spoken_ids(prompt)
    assert tok.decode(spoken) == "Good morning."
    chunk = cond.chunk(prompt, "r")
    assert chunk.is_finished and chunk.prompt_ids == tuple(prompt)
    assert chunk.token_ids == (*prompt, *spoken)
    assert chunk.prefill_embed is not None and chunk.prefill_embed.shape[0] == len(prompt) + len(spoken)
    with pytest.raises(ModelError, match="user turn"):
        cond.chunk([1, 2, 3], "r")
    with pytest.raises(ModelError, match="recomputed"):
        cond.chunk([*prompt, 5, 6], "r")  # codec ids after the prompt
