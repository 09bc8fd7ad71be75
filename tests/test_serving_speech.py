"""``/v1/audio/speech`` formats, streaming and voices; chat audio formats.

* Over the toy pipeline (24 kHz, 48 samples per code): every ``response_format`` decodes
  back with PyAV to the audio the pipeline made (its length, its rate; Opus at 48 kHz),
  streamed and whole, with its Content-Type; OpenAI's voice names map through the
  pipeline file; bad formats and voices are 400s that list the valid ones.
* Over a gated fake pipeline (in this process): the first bytes of every streamable format
  reach the client while the rest of the utterance cannot have been made yet (the fake
  makes it only when the test opens the gate), and a request that fails before any audio
  gets its JSON error.

Each test ends with a leak audit.
"""

from __future__ import annotations

import asyncio
import base64
import io
import threading
import time
from collections.abc import AsyncIterator, Iterator
from importlib.resources import files
from typing import Any

import av
import httpx
import msgspec
import numpy as np
import pytest
import torch
import yaml

from omnirelay.errors import RequestFailedError
from omnirelay.orchestrator.requests import RequestOutput
from omnirelay.pipeline import PipelineConfig, parse_pipeline
from omnirelay.serving import ServerConfig, ServerThread, create_app
from omnirelay.serving.media.encoding import FORMATS
from tests.serving_support import Served, serve, sse_events

SPEECH = "/v1/audio/speech"
RATE = 24_000
SAMPLES_PER_CODE = 48
MAX_TOKENS = 250
NUM_SAMPLES = SAMPLES_PER_CODE * MAX_TOKENS  # 12,000 samples: 0.5 s
#: Samples a file may decode to beyond the audio: the encoder's priming and padding (at most
#: two frames), which AAC in ADTS never carries and a streamed MP3 cannot (its gapless tag
#: needs a seek back).
STREAM_SLACK = {"mp3": 2 * 1152, "aac": 2 * 1024}
WHOLE_SLACK = {"aac": 2 * 1024}
MEDIA_TYPES = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}


def toy_speaker() -> PipelineConfig:
    data = yaml.safe_load((files("omnirelay") / "pipelines" / "toy-3stage.yaml").read_text())
    data["name"] = "toy-speaker"
    data["stages"][0]["sampling"]["max_tokens"] = MAX_TOKENS
    data["stages"][2]["executor_args"]["samples_per_code"] = SAMPLES_PER_CODE
    data["openai_voices"] = {"alloy": "chelsie", "Echo": "ethan"}
    return parse_pipeline(data)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(toy_speaker(), ServerConfig(max_concurrency=8))


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


def decode(data: bytes, fmt: str, rate: int = RATE) -> tuple[np.ndarray, int, str]:
    """``(mono float samples, sample rate, codec)`` of a response body, read with PyAV."""
    if fmt == "pcm":
        return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32767.0, rate, "pcm_s16le"
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        frames = [_floats(f.to_ndarray().reshape(-1)) for f in container.decode(stream)]
        codec = stream.codec_context.name
        out_rate = stream.codec_context.sample_rate
    return (np.concatenate(frames) if frames else np.zeros(0, np.float32)), out_rate, codec


def _floats(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float32) / 32767.0 if x.dtype == np.int16 else x.astype(np.float32)


def expected_length(fmt: str, num_samples: int, *, streamed: bool) -> tuple[int, int, int]:
    """``(rate, fewest, most)`` samples a body of ``num_samples`` of 24 kHz audio decodes to."""
    if fmt == "opus":
        n = num_samples * 48_000 // RATE
        return 48_000, n, n
    slack = (STREAM_SLACK if streamed else WHOLE_SLACK).get(fmt, 0)
    return RATE, num_samples, num_samples + slack


# ------------------------------------------------------------------- formats over the toy


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_each_format_decodes_to_the_audio_made(srv: Served, fmt: str) -> None:
    with httpx.stream("POST", srv.url + SPEECH, json={"input": "Hi", "response_format": fmt}) as resp:
        assert resp.status_code == 200, resp.read()
        streamed = resp.headers.get("transfer-encoding") == "chunked"
        body = resp.read()
    assert resp.headers["content-type"] == MEDIA_TYPES[fmt]
    # Every format but wav streams unasked; wav comes whole, with its sizes.
    assert streamed == (fmt != "wav")
    samples, rate, codec = decode(body, fmt)
    want_rate, fewest, most = expected_length(fmt, NUM_SAMPLES, streamed=streamed)
    assert rate == want_rate and int(resp.headers["x-sample-rate"]) == want_rate
    assert fewest <= len(samples) <= most, (fmt, len(samples))
    assert codec == {"mp3": "mp3float", "opus": "opus", "wav": "pcm_s16le"}.get(fmt, codec)
    if fmt in ("flac", "wav", "pcm"):  # lossless: the toy's full-scale samples exactly
        assert np.allclose(samples, 1.0)


def test_mp3_is_the_default_and_whole_mp3_keeps_its_exact_length(srv: Served) -> None:
    resp = httpx.post(srv.url + SPEECH, json={"input": "Hi"})
    assert resp.status_code == 200 and resp.headers["content-type"] == "audio/mpeg"
    assert len(decode(resp.content, "mp3")[0]) >= NUM_SAMPLES
    # A whole MP3 (a non-streaming chat answer) is written with a seek back to its gapless
    # tag: the decoder trims the encoder's priming and padding.
    r = httpx.post(
        srv.url + "/v1/chat/completions",
        json={
            "messages": [{"role": "user", "content": "Hi"}],
            "modalities": ["text", "audio"],
            "audio": {"voice": "alloy", "format": "mp3"},
        },
    )
    assert r.status_code == 200, r.text
    data = base64.b64decode(r.json()["choices"][0]["message"]["audio"]["data"])
    samples, rate, _ = decode(data, "mp3")
    assert (len(samples), rate) == (NUM_SAMPLES, RATE)


def test_streamed_wav_and_sse_as_asked(srv: Served) -> None:
    with httpx.stream(
        "POST", srv.url + SPEECH, json={"input": "Hi", "response_format": "wav", "stream_format": "audio"}
    ) as resp:
        body = resp.read()
        assert resp.headers.get("transfer-encoding") == "chunked"
    assert body[:4] == b"RIFF" and body[4:8] == b"\xff\xff\xff\xff"  # a header of unknown length
    assert len(decode(body, "wav")[0]) == NUM_SAMPLES
    with httpx.stream(
        "POST", srv.url + SPEECH, json={"input": "Hi", "response_format": "opus", "stream_format": "sse"}
    ) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = list(sse_events(resp.iter_lines()))
    assert [e["type"] for e in events[-1:]] == ["speech.audio.done"]
    deltas = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
    assert len(decode(b"".join(deltas), "opus")[0]) == NUM_SAMPLES * 2


@pytest.mark.parametrize("fmt", ["wav", "mp3", "opus", "aac", "flac", "pcm16"])
def test_chat_audio_formats_stream_and_whole(srv: Served, fmt: str) -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "Hi"}],
        "modalities": ["text", "audio"],
        "audio": {"voice": "ethan", "format": fmt},
    }
    whole = httpx.post(srv.url + "/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    data = base64.b64decode(whole.json()["choices"][0]["message"]["audio"]["data"])
    name = "pcm" if fmt == "pcm16" else fmt
    rate, fewest, most = expected_length(name, NUM_SAMPLES, streamed=False)
    assert fewest <= len(decode(data, name)[0]) <= most
    with httpx.stream("POST", srv.url + "/v1/chat/completions", json={**body, "stream": True}) as resp:
        chunks = list(sse_events(resp.iter_lines()))
    audio = b"".join(
        base64.b64decode(c["choices"][0]["delta"]["audio"]["data"])
        for c in chunks
        if c.get("choices") and "data" in c["choices"][0]["delta"].get("audio", {})
    )
    rate, fewest, most = expected_length(name, NUM_SAMPLES, streamed=True)
    samples, got_rate, _ = decode(audio, name)
    assert got_rate == rate and fewest <= len(samples) <= most


def test_health_audit_reports_what_the_pipeline_still_holds(srv: Served) -> None:
    plain = httpx.get(srv.url + "/health").json()
    assert "audit" not in plain  # a plain probe never asks every stage
    held = srv.frontend.submit(endpoint="chat", prompt_token_ids=[1], modalities=["text"], request_id="held")
    try:
        audit = httpx.get(srv.url + "/health", params={"audit": "1"}).json()["audit"]
        assert audit["clean"] is False and audit["num_in_flight"] == 1
    finally:
        held.close()
    srv.wait_idle()
    audit = httpx.get(srv.url + "/health", params={"audit": "1"}).json()["audit"]
    assert audit == {
        "clean": True,
        "num_in_flight": 0,
        "pipeline_requests": 0,
        "num_leaks": 0,
        "leaks": [],
        "transfer_objects": 0,
    }


# ------------------------------------------------------------------- voices and bad input


def test_openai_voice_names_map_to_the_pipelines_voices(srv: Served) -> None:
    for voice in ("alloy", "ALLOY", "echo", "Ethan", "aiden"):
        resp = httpx.post(srv.url + SPEECH, json={"input": "Hi", "voice": voice, "response_format": "pcm"})
        assert resp.status_code == 200, (voice, resp.text)
    assert srv.frontend.check_voice("alloy") == "chelsie" and srv.frontend.check_voice("ECHO") == "ethan"


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        (
            {"response_format": "ogg"},
            "response_format",
            "supported: ['mp3', 'opus', 'aac', 'flac', 'wav', 'pcm']",
        ),
        ({"response_format": "MP3"}, "response_format", "'MP3' is not supported"),
        (
            {"voice": "nova"},
            "voice",
            "unknown voice 'nova'; supported voices: ['aiden', 'chelsie', 'ethan']; "
            "OpenAI names it maps: ['alloy', 'echo']",
        ),
        ({"voice": 7}, "voice", "voice: Input should be a valid string"),
    ],
)
def test_bad_format_or_voice_is_a_400_that_lists_the_valid_ones(
    srv: Served, body: dict[str, Any], param: str, needle: str
) -> None:
    resp = httpx.post(srv.url + SPEECH, json={"input": "Hi", **body})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert needle in error["message"] and error["param"] == param


def test_chat_refuses_an_audio_format_openai_does_not_have(srv: Served) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "modalities": ["audio"],
        "audio": {"format": "pcm"},
    }
    resp = httpx.post(srv.url + "/v1/chat/completions", json=body)
    assert resp.status_code == 400
    assert (
        "supported formats: ['wav', 'mp3', 'opus', 'aac', 'flac', 'pcm16']" in resp.json()["error"]["message"]
    )


# ------------------------------------------------------------------- streaming, forced


class HeldHandle:
    """A request handle of the fake pipelines: its outputs, and its id held until the
    server closes it (tests/test_serving_realtime_transcription.py uses it too)."""

    def __init__(self, request_id: str, outputs: AsyncIterator[RequestOutput], held: set[str]) -> None:
        self.request_id = request_id
        self._outputs = outputs
        self._held = held

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._outputs

    def close(self) -> None:
        self._held.discard(self.request_id)  # the server sent the response: the id is free


class GatedPipeline:
    """An in-process stand-in for a started pipeline (what the server calls of one): each
    request yields :data:`FIRST` samples, then makes the rest only once the test opens
    :attr:`gate`; with :attr:`fail_at` it fails there instead (``"start"``: before any
    audio, ``"gate"``: after the first samples)."""

    def __init__(self, config: PipelineConfig) -> None:
        self.config = config
        self.gate = threading.Event()
        self.at_gate = threading.Event()  # a request made its first samples; the rest waits
        self.fail_at: str | None = None
        self.active: set[str] = set()
        self.held: set[str] = set()  # ids whose handle the server has not closed yet
        self.aborted: set[str] = set()

    def submit(self, prompt: list[int], *, request_id: str, **_: Any) -> HeldHandle:
        self.active.add(request_id)
        self.held.add(request_id)
        return HeldHandle(request_id, self._outputs(request_id), self.held)

    def abort(self, request_id: str) -> None:
        self.aborted.add(request_id)

    def capacity_problem(self, modalities: Any) -> None:
        return None  # a stand-in with room for every stream

    def is_in_flight(self, request_id: str) -> bool:
        return request_id in self.held

    def prompt_side(self) -> None:
        return None  # no text model: the server's byte codec

    async def _outputs(self, rid: str) -> AsyncIterator[RequestOutput]:
        try:
            if self.fail_at == "start":
                raise RequestFailedError(rid, "stage 'synth' failed: boom")
            # Set before the first samples leave: the client may read them before this
            # generator is resumed, but the rest can only come after the gate opens.
            self.at_gate.set()
            yield self._audio(rid, FIRST, 0.25)
            while not self.gate.is_set() and rid not in self.aborted:
                await asyncio.sleep(0.002)  # polls the test's gate; the loop serves others meanwhile
            if rid in self.aborted:
                return
            if self.fail_at == "gate":
                raise RequestFailedError(rid, "stage 'synth' failed: boom")
            out = self._audio(rid, REST, -0.25)
            yield msgspec.structs.replace(out, stage_finished=True, finished=True, finish_reason="stop")
        finally:
            self.active.discard(rid)

    @staticmethod
    def _audio(rid: str, n: int, value: float) -> RequestOutput:
        audio = torch.full((n,), value)
        return RequestOutput(request_id=rid, stage_id=2, modality="audio", audio=audio, sample_rate=RATE)


FIRST = 12_000
REST = 12_000


@pytest.fixture(scope="module")
def gated_server() -> Iterator[tuple[GatedPipeline, ServerThread]]:
    pipe = GatedPipeline(toy_speaker())
    with ServerThread(create_app(pipe, ServerConfig(max_concurrency=4))) as server:  # type: ignore[arg-type]
        yield pipe, server


@pytest.fixture
def gated(gated_server: tuple[GatedPipeline, ServerThread]) -> Iterator[tuple[GatedPipeline, str]]:
    pipe, server = gated_server
    pipe.gate.clear()
    pipe.at_gate.clear()
    pipe.fail_at = None
    yield pipe, server.base_url
    # The leak audit: every request ends in the fake and in the server's books (the server
    # closes a request after its last bytes went out: wait for that, with a deadline).
    fe = server._server.config.app.state.frontend
    deadline = time.monotonic() + 10
    while pipe.active or fe.admission.num_active or pipe.held:
        assert time.monotonic() < deadline, (pipe.active, fe.admission.num_active, pipe.held)
        time.sleep(0.005)


STREAMED = [
    ("mp3", {}),
    ("opus", {}),
    ("aac", {}),
    ("flac", {}),
    ("pcm", {}),
    ("wav", {"stream_format": "audio"}),
    ("pcm", {"stream": True}),
]


@pytest.mark.parametrize(
    ("fmt", "extra"), STREAMED, ids=[f"{f}{'+' if e else ''}{''.join(e)}" for f, e in STREAMED]
)
def test_first_bytes_arrive_before_the_rest_is_made(
    gated: tuple[GatedPipeline, str], fmt: str, extra: dict[str, Any]
) -> None:
    pipe, url = gated
    body = {"input": "Hi", "response_format": fmt, **extra}
    with httpx.stream("POST", url + SPEECH, json=body, timeout=30) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_raw()
        first = next(chunks)
        # The rest of the utterance cannot exist yet: the fake makes it after the gate.
        assert first and pipe.at_gate.is_set() and not pipe.gate.is_set()
        pipe.gate.set()
        data = first + b"".join(chunks)
    samples, rate, _ = decode(data, fmt)
    want_rate, fewest, most = expected_length(fmt, FIRST + REST, streamed=True)
    assert rate == want_rate and fewest <= len(samples) <= most


def test_sse_deltas_arrive_before_the_rest_is_made(gated: tuple[GatedPipeline, str]) -> None:
    pipe, url = gated
    body = {"input": "Hi", "response_format": "flac", "stream_format": "sse"}
    with httpx.stream("POST", url + SPEECH, json=body, timeout=30) as resp:
        events = sse_events(resp.iter_lines())
        first = next(events)
        assert first["type"] == "speech.audio.delta" and not pipe.gate.is_set()
        pipe.gate.set()
        rest = list(events)
    assert rest[-1]["type"] == "speech.audio.done"
    audio = b"".join(
        base64.b64decode(e["audio"]) for e in [first, *rest] if e["type"] == "speech.audio.delta"
    )
    assert len(decode(audio, "flac")[0]) == FIRST + REST


def test_a_failure_before_any_audio_is_a_json_error(gated: tuple[GatedPipeline, str]) -> None:
    pipe, url = gated
    pipe.fail_at = "start"
    for extra in ({}, {"stream_format": "sse"}):
        resp = httpx.post(url + SPEECH, json={"input": "Hi", **extra}, timeout=30)
        assert resp.status_code == 500 and resp.headers["content-type"] == "application/json"
        assert (
            "the pipeline failed the request: stage 'synth' failed: boom" in resp.json()["error"]["message"]
        )


def test_a_failure_mid_stream_is_an_sse_error_event(gated: tuple[GatedPipeline, str]) -> None:
    pipe, url = gated
    pipe.fail_at = "gate"
    pipe.gate.set()
    with httpx.stream("POST", url + SPEECH, json={"input": "Hi", "stream_format": "sse"}, timeout=30) as resp:
        events = list(sse_events(resp.iter_lines()))
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error"
    assert events[-1]["error"]["message"] == "the request failed mid-stream: stage 'synth' failed: boom"
    assert events[-1]["error"]["type"] == "server_error"  # an OpenAI-style error body


def test_a_client_gone_mid_stream_aborts_its_request(gated: tuple[GatedPipeline, str]) -> None:
    pipe, url = gated
    with httpx.stream("POST", url + SPEECH, json={"input": "Hi"}, timeout=30) as resp:
        assert next(resp.iter_raw())
        rid = resp.headers["x-request-id"]
    # Leaving the block closed the connection while the request waited at the gate.
    deadline = time.monotonic() + 10
    while rid not in pipe.aborted or pipe.active:
        assert time.monotonic() < deadline, "the request was not aborted"
        time.sleep(0.005)
