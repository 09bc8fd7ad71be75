"""The server over the deterministic toy pipeline (counter -> relay -> synth) with the
weight-free aligner as a fourth stage (complete waveform, docs/protocol.md §5.4), where model
semantics do not matter: the OpenAI client, bad input, admission, client disconnects,
the WebSocket protocol's rules, word timestamps, /health and /metrics. Each test ends
with a leak audit (no request state in any stage, no transfer object); the module ends
with shutdown's.

With the byte codec a prompt is its UTF-8 bytes and the counter continues from the last
byte: ``user: Hi`` ends in ``i`` (105), so the answer is ``jklmn...``.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
from collections.abc import Iterator
from importlib.resources import files

import httpx
import openai
import pytest
import websockets
import yaml

from omnirelay.pipeline import PipelineConfig, parse_pipeline
from omnirelay.serving import AdmissionGate, ServerConfig
from tests.serving_support import Served, chat_stream_audio, disconnect_after_first_audio, serve

MAX_CONCURRENCY = 64
CONFIG = ServerConfig(
    max_concurrency=MAX_CONCURRENCY,
    max_body_bytes=64 * 1024,
    max_input_chars=1000,
    ws_max_text_bytes=2048,
    ws_first_config_timeout_s=0.5,
    ws_idle_timeout_s=0.5,
)
HI = [{"role": "user", "content": "Hi"}]


def toy_with_aligner() -> PipelineConfig:
    """toy-3stage plus ``aligner.vad`` on synth's finished waveform (a complete-input edge)."""
    data = yaml.safe_load((files("omnirelay") / "pipelines" / "toy-3stage.yaml").read_text())
    data["name"] = "toy-aligner"
    data["stages"][0]["sampling"]["max_tokens"] = 1000  # speech: 4,000 samples (167 ms)
    data["stages"].append(
        {
            "id": 3,
            "name": "aligner",
            "execution_type": "generation",
            "executor": "aligner.vad",
            "input_sources": [2],
            "async_chunk": False,
            "async_scheduling": False,
            "input_builder": "code2wav_to_aligner",
            "final_output": True,
            "final_output_type": "timestamps",
        }
    )
    return parse_pipeline(data)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(toy_with_aligner(), CONFIG, AdmissionGate(MAX_CONCURRENCY, retry_after_s=2))


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


# ------------------------------------------------------------------- happy paths


def test_models_lists_the_pipeline(srv: Served) -> None:
    models = srv.client().models.list()
    assert [m.id for m in models.data] == ["toy-aligner"]


def test_chat_text_only(srv: Served) -> None:
    r = srv.client().chat.completions.create(model=srv.model, messages=HI, modalities=["text"], max_tokens=5)
    assert r.choices[0].message.content == "jklmn"
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].message.audio is None
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(b"user: Hi"), 5)


def test_chat_stream_text_and_audio(srv: Served) -> None:
    chunks = srv.client().chat.completions.create(
        model=srv.model,
        messages=HI,
        modalities=["text", "audio"],
        audio={"voice": "ethan", "format": "pcm16"},
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, audio, seen = chat_stream_audio(chunks)
    assert text == "jklmn"
    # relay: 2t+1 per token, synth: 4 samples per code (clipped to full scale)
    assert len(audio) == 5 * 4 * 2
    assert seen[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in seen if c.choices][-1] == "length"
    assert seen[-1].usage is not None and seen[-1].usage.completion_tokens == 5


def test_stop_sequence_ends_the_answer(srv: Served) -> None:
    r = srv.client().chat.completions.create(model=srv.model, messages=HI, max_tokens=50, stop=["m"])
    assert r.choices[0].message.content == "jkl"
    assert r.choices[0].finish_reason == "stop"
    assert srv.metric("omnirelay_aborts_total", reason="stop_sequence") >= 1


def test_speech_pcm_and_wav_and_stream(srv: Served) -> None:
    client = srv.client()
    pcm = client.audio.speech.create(model=srv.model, voice="aiden", input="Hello", response_format="pcm")
    wav = client.audio.speech.create(model=srv.model, voice="aiden", input="Hello", response_format="wav")
    assert wav.content[:4] == b"RIFF" and wav.content[44:] == pcm.content and len(pcm.content) > 0
    with client.audio.speech.with_streaming_response.create(
        model=srv.model, voice="aiden", input="Hello", response_format="pcm", stream_format="audio"
    ) as resp:
        streamed = b"".join(resp.iter_bytes())
    assert streamed == pcm.content


# ------------------------------------------------------------------- bad input

CHAT = "/v1/chat/completions"
SPEECH = "/v1/audio/speech"
BAD_REQUESTS = [
    ("malformed json", CHAT, b'{"messages": [', 400, "not valid JSON"),
    ("not an object", CHAT, b"[1, 2]", 400, "must be a JSON object"),
    ("empty body", CHAT, b"", 400, "body is empty"),
    ("unknown model", CHAT, {"model": "gpt-9", "messages": HI}, 404, "does not exist"),
    (
        "unknown modality",
        CHAT,
        {"messages": HI, "modalities": ["text", "video"]},
        400,
        "supports ['text', 'audio']",
    ),
    ("modalities not a list", CHAT, {"messages": HI, "modalities": "text"}, 400, "list of strings"),
    ("no messages", CHAT, {"messages": []}, 400, "messages"),
    (
        "image part",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "text parts",
    ),
    (
        "audio without modality",
        CHAT,
        {"messages": HI, "modalities": ["text"], "audio": {"voice": "ethan"}},
        400,
        "add it",
    ),
    (
        "bad audio format",
        CHAT,
        {"messages": HI, "modalities": ["audio"], "audio": {"format": "ogg"}},
        400,
        "supported formats: ['wav', 'mp3', 'opus', 'aac', 'flac', 'pcm16']",
    ),
    (
        "unknown voice",
        CHAT,
        {"messages": HI, "modalities": ["audio"], "audio": {"voice": "hal"}},
        400,
        "voices",
    ),
    ("n > 1", CHAT, {"messages": HI, "n": 2}, 400, "one choice per request"),
    ("max_tokens over limit", CHAT, {"messages": HI, "max_tokens": 10**6}, 400, "the limit is 8192"),
    ("oversize prompt", CHAT, {"messages": [{"role": "user", "content": "x" * 1001}]}, 400, "limit is 1000"),
    ("too many stops", CHAT, {"messages": HI, "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4"),
    ("empty input", SPEECH, {"input": "  "}, 400, "input is empty"),
    ("oversize input", SPEECH, {"input": "x" * 1001}, 400, "limit is 1000"),
    (
        "stream with timestamps",
        SPEECH,
        {"input": "hi", "stream": True, "word_timestamps": True},
        400,
        "/v1/audio/speech/stream",
    ),
    (
        "unknown format",
        SPEECH,
        {"input": "hi", "response_format": "m4a"},
        400,
        "'m4a' is not supported; supported: ['mp3', 'opus', 'aac', 'flac', 'wav', 'pcm']",
    ),
    ("unknown voice", SPEECH, {"input": "hi", "voice": "hal"}, 400, "supported voices: ['aiden', 'chelsie'"),
    ("speed", SPEECH, {"input": "hi", "speed": 1.5}, 400, "only 1.0"),
    ("stream_format", SPEECH, {"input": "hi", "stream_format": "ogg"}, 400, "'audio' or 'sse'"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "needle"), [b[1:] for b in BAD_REQUESTS], ids=[b[0] for b in BAD_REQUESTS]
)
def test_bad_input_gets_a_4xx_that_says_what_to_fix(
    srv: Served, path: str, body: bytes | dict[str, object], status: int, needle: str
) -> None:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = httpx.post(srv.url + path, content=content, headers={"Content-Type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert needle in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_oversize_body_is_413_and_the_server_stays_healthy(srv: Served) -> None:
    big = json.dumps({"messages": [{"role": "user", "content": "x" * 100_000}]})
    resp = httpx.post(srv.url + CHAT, content=big, headers={"Content-Type": "application/json"})
    assert resp.status_code == 413 and "limit is 65536 bytes" in resp.json()["error"]["message"]
    assert httpx.get(srv.url + "/health").json()["status"] == "healthy"
    r = srv.client().chat.completions.create(model=srv.model, messages=HI, modalities=["text"], max_tokens=2)
    assert r.choices[0].message.content == "jk"


def test_bad_request_id_header_is_400(srv: Served) -> None:
    resp = httpx.post(srv.url + CHAT, json={"messages": HI}, headers={"X-Request-Id": "r" * 300})
    assert resp.status_code == 400 and "X-Request-Id" in resp.json()["error"]["message"]


def test_client_request_id_is_echoed_and_reuse_in_flight_is_409(srv: Served) -> None:
    resp = httpx.post(
        srv.url + CHAT, json={"messages": HI, "max_tokens": 1}, headers={"X-Request-Id": "my-id"}
    )
    assert (
        resp.status_code == 200 and resp.headers["x-request-id"] == "my-id" and resp.json()["id"] == "my-id"
    )
    # Hold "taken" in flight from here (its outputs are never read), then reuse it over HTTP.
    held = srv.frontend.submit(endpoint="chat", prompt_token_ids=[1], modalities=["text"], request_id="taken")
    try:
        again = httpx.post(srv.url + CHAT, json={"messages": HI}, headers={"X-Request-Id": "taken"})
        assert again.status_code == 409 and "already in flight" in again.json()["error"]["message"]
    finally:
        held.close()  # aborts it through every stage
    ok = httpx.post(srv.url + CHAT, json={"messages": HI, "max_tokens": 1}, headers={"X-Request-Id": "taken"})
    assert ok.status_code == 200


# ------------------------------------------------------------------- admission, disconnects


def test_over_concurrency_is_429_with_retry_after(srv: Served) -> None:
    adm = srv.frontend.admission
    held = [adm.acquire() for _ in range(MAX_CONCURRENCY)]
    try:
        resp = httpx.post(srv.url + CHAT, json={"messages": HI})
        assert resp.status_code == 429 and resp.headers["retry-after"] == "2"
        assert "64 concurrent requests" in resp.json()["error"]["message"]
        with pytest.raises(openai.RateLimitError):
            srv.client().chat.completions.create(model=srv.model, messages=HI)
    finally:
        for slot in held:
            slot.release()
    assert srv.metric("omnirelay_requests_total", endpoint="chat", outcome="rejected") >= 2
    r = srv.client().chat.completions.create(model=srv.model, messages=HI, modalities=["text"], max_tokens=1)
    assert r.choices[0].message.content == "j"


def test_fifty_clients_gone_after_first_audio_leave_nothing(srv: Served) -> None:
    before = srv.metric("omnirelay_aborts_total", reason="client_disconnect")
    body = {"messages": HI, "modalities": ["text", "audio"], "max_tokens": 8000, "stream": True}
    assert asyncio.run(disconnect_after_first_audio(srv.url, body, 50)) == 50
    srv.wait_idle()
    assert srv.metric("omnirelay_aborts_total", reason="client_disconnect") - before == 50
    srv.audit()  # zero objects, zero request state in every stage
    r = srv.client().chat.completions.create(model=srv.model, messages=HI, modalities=["text"], max_tokens=3)
    assert r.choices[0].message.content == "jkl"


def test_non_streaming_client_gone_aborts(srv: Served) -> None:
    before = srv.metric("omnirelay_aborts_total", reason="client_disconnect")
    body = {"messages": HI, "modalities": ["text", "audio"], "max_tokens": 8000}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(srv.url + CHAT, json=body, timeout=httpx.Timeout(30, read=0.3))
    srv.wait_idle()
    assert srv.metric("omnirelay_aborts_total", reason="client_disconnect") - before == 1


# ------------------------------------------------------------------- WebSocket rules


async def _ws_session(url: str, *messages: str | bytes) -> tuple[list[str | bytes], int | None]:
    """Send ``messages``, then read until the server closes; the messages and the close code."""
    got: list[str | bytes] = []
    async with websockets.connect(url) as ws:
        for m in messages:
            await ws.send(m)
        try:
            async for m in ws:
                got.append(m)
        except websockets.ConnectionClosedError:
            pass  # a policy-violation close: its code is checked by the caller
        return got, ws.close_code


async def _ws_messages(url: str, *messages: str | bytes) -> list[str | bytes]:
    got, code = await _ws_session(url, *messages)
    assert code == 1000, code
    return got


def _json(messages: list[str | bytes]) -> list[dict[str, object]]:
    return [json.loads(m) for m in messages if isinstance(m, str)]


def test_ws_message_before_config_is_refused(srv: Served) -> None:
    messages, code = asyncio.run(_ws_session(srv.ws_url, json.dumps({"type": "input.text", "text": "hi"})))
    got = _json(messages)
    assert code == 1008 and got[0]["type"] == "error" and got[0]["code"] == "config_required"
    assert "session.config" in str(got[0]["message"])


def test_ws_first_config_timeout(srv: Served) -> None:
    messages, code = asyncio.run(_ws_session(srv.ws_url))
    assert code == 1008
    assert _json(messages) == [
        {"type": "error", "message": "no session.config within 0.5 s; closing", "code": "timeout"}
    ]


def test_ws_errors_keep_the_session_and_split_sentences(srv: Served) -> None:
    cfg = {"type": "session.config", "voice": "ethan", "response_format": "pcm", "split": "sentence"}
    msgs = [
        json.dumps({"type": "session.config", "split": "paragraph"}),  # invalid: error, keeps the socket
        json.dumps(
            {"type": "session.config", "word_timestamps": True, "response_format": "wav"}
        ),  # needs pcm
        json.dumps({"type": "session.config", "model": "gpt-4o-mini-tts"}),  # not this server's
        json.dumps({"type": "session.config", "response_format": "ogg"}),  # not one of speech's
        json.dumps(cfg),
        json.dumps({"type": "input.text", "text": "x" * 3000}),  # over 2,048 bytes a message
        json.dumps({"type": "input.done"}),  # nothing buffered
        json.dumps({"type": "input.text", "text": "One. Two"}),
        json.dumps({"type": "input.text", "text": "! Three"}),
        json.dumps({"type": "input.done"}),
        json.dumps({"type": "session.config", "split": "clause", "model": srv.model}),
        json.dumps({"type": "input.text", "text": "Four, five"}),
        json.dumps({"type": "input.done"}),
        json.dumps({"type": "session.close"}),
    ]
    got = asyncio.run(_ws_messages(srv.ws_url, *msgs))
    events = _json(got)
    errors = [(e["code"], e["message"]) for e in events if e["type"] == "error"]
    assert [code for code, _ in errors] == [
        "invalid_config",
        "invalid_config",
        "invalid_config",
        "invalid_config",
        "message_too_large",
        "empty_input",
    ]
    assert "the model 'gpt-4o-mini-tts' does not exist" in errors[2][1]
    assert "'mp3', 'opus', 'aac', 'flac', 'wav', 'pcm'" in errors[3][1]
    starts = [e for e in events if e["type"] == "audio.start"]
    assert [(s["utterance_index"], s["sentence_index"], s["sentence_text"]) for s in starts] == [
        (0, 0, "One."),
        (0, 1, "Two!"),
        (0, 2, "Three"),
        (1, 0, "Four,"),
        (1, 1, "five"),
    ]
    assert all(s["sample_rate"] == 24000 and s["format"] == "pcm" for s in starts)
    dones = [e for e in events if e["type"] == "audio.done"]
    audio = [m for m in got if isinstance(m, bytes)]
    assert sum(int(d["total_bytes"]) for d in dones) == sum(map(len, audio)) > 0
    assert all(d["error"] is None for d in dones)
    assert events[-1] == {"type": "session.done", "num_utterances": 2}


def test_ws_idle_timeout_closes(srv: Served) -> None:
    messages, code = asyncio.run(_ws_session(srv.ws_url, json.dumps({"type": "session.config"})))
    assert code == 1008
    assert _json(messages) == [
        {"type": "error", "message": "no message within 0.5 s; closing", "code": "timeout"}
    ]


# ------------------------------------------------------------------- health, metrics


def test_health_and_metrics(srv: Served) -> None:
    health = httpx.get(srv.url + "/health").json()
    assert health["status"] == "healthy" and health["model"] == "toy-aligner"
    assert [(s["stage_id"], s["name"], s["is_alive"]) for s in health["stages"]] == [
        (0, "counter", True),
        (1, "relay", True),
        (2, "synth", True),
        (3, "aligner", True),
    ]
    text = httpx.get(srv.url + "/metrics").text
    for name in (
        "omnirelay_time_to_first_audio_seconds_bucket",
        "omnirelay_first_playable_audio_seconds_bucket",
        "omnirelay_audio_streams_total",
        "omnirelay_real_time_factor_bucket",
        "omnirelay_aborts_total",
        "omnirelay_requests_total",
        "omnirelay_stage_up",
        "omnirelay_stage_queue_depth",
        "omnirelay_stage_pending_objects",
        "omnirelay_stage_live_bytes",
        "omnirelay_stage_transfer_bytes_total",
    ):
        assert name in text, name
    assert 'omnirelay_stage_up{stage="2:synth"} 1.0' in text


# ------------------------------------------------------------------- word timestamps


def _check_words(stamps: object, text: str, duration_ms: float) -> None:
    assert isinstance(stamps, list)
    assert [w["word"] for w in stamps] == text.replace(",", "").replace(".", "").split()
    ends = 0
    for w in stamps:
        assert ends <= w["start_ms"] <= w["end_ms"] <= duration_ms  # monotonic, within the audio
        ends = w["end_ms"]
    assert stamps[-1]["end_ms"] == pytest.approx(duration_ms, abs=20)  # the toy "speaks" throughout


def test_speech_word_timestamps_header(srv: Served) -> None:
    text = "Hello big, wide world."
    resp = httpx.post(
        srv.url + SPEECH, json={"input": text, "response_format": "pcm", "word_timestamps": True}
    )
    assert resp.status_code == 200, resp.text
    duration_ms = len(resp.content) / 2 / 24000 * 1000
    _check_words(json.loads(resp.headers["x-word-timestamps"]), text, duration_ms)
    # The audio alone (no timestamps asked): the same bytes, and the aligner never runs.
    plain = httpx.post(srv.url + SPEECH, json={"input": text, "response_format": "pcm"})
    assert plain.content == resp.content and "x-word-timestamps" not in plain.headers


def test_speech_word_timestamps_oversize_header_is_omitted(srv: Served) -> None:
    text = " ".join(f"w{i}" for i in range(150))  # under 1,000 characters, over 4,096 bytes of JSON
    resp = httpx.post(
        srv.url + SPEECH, json={"input": text, "response_format": "wav", "word_timestamps": True}
    )
    assert resp.status_code == 200 and "x-word-timestamps" not in resp.headers
    omitted = resp.headers["x-word-timestamps-omitted"]
    assert omitted.startswith("oversize; bytes=") and omitted.endswith("; limit=4096")


def test_ws_word_timestamps_in_a_trailing_empty_chunk(srv: Served) -> None:
    text = "Hello big, wide world."
    cfg = {"type": "session.config", "response_format": "pcm", "stream_audio": True, "word_timestamps": True}
    msgs = [
        json.dumps(cfg),
        json.dumps({"type": "input.text", "text": text}),
        json.dumps({"type": "input.done"}),
    ]
    got = asyncio.run(_ws_messages(srv.ws_url, *msgs, json.dumps({"type": "session.close"})))
    assert all(isinstance(m, str) for m in got)  # timestamps mode: JSON audio.chunk frames only
    events = _json(got)
    assert events[0]["type"] == "audio.start" and events[0]["word_timestamps"] is True
    chunks = [e for e in events if e["type"] == "audio.chunk"]
    audio = b"".join(base64.b64decode(str(c["audio_b64"])) for c in chunks)
    *body, trailer = chunks
    assert body and all(c["timestamps"] is None for c in body)
    assert [c["chunk_id"] for c in chunks] == list(range(len(chunks)))
    for prev, cur in itertools.pairwise(body):
        assert cur["chunk_start_ms"] == prev["chunk_end_ms"]
    assert trailer["audio_b64"] == "" and trailer["chunk_start_ms"] == trailer["chunk_end_ms"]
    duration_ms = len(audio) / 2 / 24000 * 1000
    assert trailer["chunk_end_ms"] == pytest.approx(duration_ms, abs=1e-3)
    _check_words(trailer["timestamps"], text, duration_ms)
    # Each sample exactly once: the same audio as the HTTP endpoint's.
    http = httpx.post(srv.url + SPEECH, json={"input": text, "response_format": "pcm"})
    assert audio == http.content
    done = [e for e in events if e["type"] == "audio.done"]
    assert done[0]["total_bytes"] == len(audio) and done[0]["error"] is None
