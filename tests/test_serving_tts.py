"""The server over ``qwen3-tts-tiny`` (the tiny Qwen3-TTS: Talker -> Code2Wav, chunked ->
PocketSphinx aligner on the complete waveform; real multi-process path): speech with word
timestamps over HTTP and the WebSocket, streaming speech, the ``openai`` client, the
model's speakers as voices and OpenAI's names mapped to them, instructions and language;
and, on its own, the prompt side's answer to which models take instructions (and the
Qwen3-Omni Talker's text mode).

The Talker samples with its config's fixed seed, so one input gives the same waveform on
every request: the WebSocket's audio must equal the HTTP endpoint's, sample for sample.
"""

from __future__ import annotations

import asyncio
import base64
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import httpx
import numpy as np
import pytest
import websockets

from omnirelay.cli.serve import server_config
from omnirelay.models.qwen3_omni.prompt import QwenPromptSide
from omnirelay.models.qwen3_tts.prompt import open_prompt_side
from omnirelay.pipeline import load_pipeline
from omnirelay.serving import ServerConfig
from omnirelay.serving.errors import ApiError
from omnirelay.serving.frontend import Frontend
from omnirelay.serving.media.audio_out import parse_wav
from tests.serving_support import Served, assert_same_pcm, serve

MODEL = "qwen3-tts-tiny"
SPEECH = "/v1/audio/speech"
TEXT = "Hello big, wide world."
SPEAKERS = ["serena", "vivian", "uncle_fu", "ryan", "aiden", "ono_anna", "sohee", "eric", "dylan"]


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(MODEL, server_config(load_pipeline(MODEL)))


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


def _pcm(served: Served, **body: Any) -> bytes:
    resp = httpx.post(
        served.url + SPEECH,
        json={"model": MODEL, "input": TEXT, "response_format": "pcm", **body},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert "x-word-timestamps" not in resp.headers and resp.content
    return resp.content


def _differs(a: bytes, b: bytes) -> bool:
    """Another answer, not the same one rounded differently (see ``assert_same_pcm``)."""
    if len(a) != len(b):
        return True
    x, y = np.frombuffer(a, dtype="<i2").astype(np.int32), np.frombuffer(b, dtype="<i2").astype(np.int32)
    return bool((np.abs(x - y) > 1).mean() > 0.5)


@pytest.fixture(scope="module")
def reference(served: Served) -> bytes:
    """The PCM of one non-streaming request for TEXT in the default voice, without timestamps."""
    pcm = _pcm(served)
    served.audit()
    return pcm


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
        model=MODEL, voice="echo", input=TEXT, response_format="pcm", extra_body={"stream": True}
    ) as resp:  # OpenAI's echo speaks as ryan, the default speaker
        streamed = resp.read()
    assert_same_pcm(streamed, reference)


def test_the_speakers_are_the_voices_and_each_speaks_its_own(srv: Served, reference: bytes) -> None:
    models = httpx.get(srv.url + "/v1/models", timeout=30)
    assert models.status_code == 200
    assert srv.frontend.config.voices == tuple(SPEAKERS) and srv.frontend.config.default_voice == "ryan"
    assert_same_pcm(_pcm(srv, voice="ryan"), reference)
    assert _differs(_pcm(srv, voice="Serena"), reference)  # another speaker's embedding, another voice
    resp = httpx.post(srv.url + SPEECH, json={"model": MODEL, "input": TEXT, "voice": "chelsie"}, timeout=30)
    assert resp.status_code == 400 and "unknown voice 'chelsie'" in resp.json()["error"]["message"]


def test_instructions_and_language_are_followed(srv: Served, reference: bytes) -> None:
    instructed = _pcm(srv, instructions="Speak slowly and warmly.")
    assert _differs(instructed, reference)  # the instruction's rows lead the Talker's prefill
    assert_same_pcm(_pcm(srv, instructions="   "), reference)  # blank: none
    assert _differs(_pcm(srv, language="English"), reference)  # a language id instead of auto
    resp = httpx.post(
        srv.url + SPEECH, json={"model": MODEL, "input": TEXT, "language": "klingon"}, timeout=30
    )
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "language"
    assert "'english'" in resp.json()["error"]["message"]


async def _ws(url: str, text: str, **settings: Any) -> list[Any]:
    cfg = {
        "type": "session.config",
        "response_format": "pcm",
        "stream_audio": True,
        "word_timestamps": True,
        **settings,
    }
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


def test_websocket_instructions_and_language_reach_the_talker(srv: Served, reference: bytes) -> None:
    for settings in ({"instructions": "Speak slowly and warmly."}, {"language": "English"}):
        got = asyncio.run(_ws(srv.ws_url, TEXT, word_timestamps=False, **settings))
        audio = b"".join(m for m in got if isinstance(m, bytes))
        assert audio and len(audio) == len(audio) // 2 * 2
        events = [json.loads(m) for m in got if isinstance(m, str)]
        assert events[-1]["type"] == "session.done" and not [e for e in events if e["type"] == "error"]
        assert _differs(audio, reference), settings
    # A language the model is not told: an error frame, and the session goes on.

    async def refused() -> list[dict[str, Any]]:
        async with websockets.connect(srv.ws_url) as ws:
            for msg in ({"type": "session.config"}, {"type": "session.config", "language": "klingon"}):
                await ws.send(json.dumps(msg))
            await ws.send(json.dumps({"type": "session.close"}))
            return [json.loads(m) async for m in ws]

    events = asyncio.run(refused())
    assert [(e["type"], e.get("code")) for e in events] == [
        ("error", "invalid_config"),
        ("session.done", None),
    ]
    assert "unsupported language 'klingon'" in events[0]["message"]


# ------------------------------------------------------------------- on their own


@pytest.mark.parametrize(("model", "takes"), [("1.7b-customvoice", True), ("0.6b-customvoice", False)])
def test_which_models_take_instructions(model: str, takes: bool) -> None:
    """The family's answer through the prompt side, and the front's 400 for a refusal."""
    prompts = open_prompt_side({"tiny": True, "model": model})
    refusal = prompts.instructions_refusal("ryan")
    assert (refusal is None) is takes
    pipeline = load_pipeline(MODEL)
    fe = Frontend(
        SimpleNamespace(config=pipeline),  # type: ignore[arg-type]
        ServerConfig(voices=tuple(SPEAKERS), default_voice="ryan"),
        prompts,
    )
    if takes:
        assert fe.check_speech_options("ryan", "Whisper.", "english") == ("Whisper.", "english")
        prompt = prompts.speech_prompt(TEXT, voice="ryan", instructions="Whisper.")
        assert prompt.inputs["instruct_ids"][:3] == prompts.tokenizer.encode("<|im_start|>user\n")
    else:
        with pytest.raises(ApiError) as info:
            fe.check_speech_options("ryan", "Whisper.", None)
        assert info.value.status == 400 and info.value.param == "instructions"
        assert "0.6B-CustomVoice does not take instructions" in info.value.message
        assert fe.check_speech_options("ryan", None, "chinese") == (None, "chinese")


# ------------------------------------------------------------------- Qwen3-Omni's text mode


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
