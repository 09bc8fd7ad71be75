"""The default ``voice-cpu`` pipeline end to end (real models, real processes, the default
``omnirelay serve`` configuration): the chunked Thinker -> voice edge, speech read
verbatim, word timestamps over HTTP and the WebSocket, every audio format of the
WebSocket decoding to the speech endpoint's duration, chat with audio. Every test ends
with a leak audit; the module ends with the shutdown audit.

Sampling is seeded in the pipeline file (Thinker and voice), so one prompt gives one
answer and one waveform, whichever way the edge carries the text.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import av
import httpx
import numpy as np
import openai
import pytest
import torch
import websockets

from omnirelay.api import Pipeline
from omnirelay.cli.serve import DEFAULT_PIPELINE, server_config
from omnirelay.engine.interfaces import SamplingParams
from omnirelay.errors import StageUnavailableError
from omnirelay.models import prompt_side
from omnirelay.models.asr.sphinx import Recognizer, word_error_rate
from omnirelay.models.inputs import AUDIO_INPUT_RATE, audio_inputs
from omnirelay.models.text.spoken import spoken_words
from omnirelay.orchestrator.requests import RequestOutput
from omnirelay.pipeline import load_pipeline
from omnirelay.serving.media.audio_in import decode_audio
from omnirelay.serving.media.audio_out import parse_wav
from omnirelay.serving.media.encoding import FORMATS
from tests.orchestrator_audit import audit_running, audit_stopped
from tests.serving_support import Served, serve

SPEECH = "/v1/audio/speech"
#: Two sentences: the WebSocket splits them into two requests; speech reads both at once.
TEXT = "Good morning to you all. The train leaves at nine o'clock sharp."
#: A prompt whose answer (seeded) has several sentences, so the voice starts before the end.
PROMPT = "Tell me about the moon in three sentences."
#: The voice's own rate (a WAV's header says it) ...
RATE = 22050
#: ... and raw pcm's on the wire, OpenAI's, whatever the voice's rate.
PCM_RATE = 24000


def test_voice_cpu_is_the_default_of_run_and_serve() -> None:
    from omnirelay.cli.session import DEFAULT_PIPELINE as RUN_DEFAULT

    assert DEFAULT_PIPELINE == RUN_DEFAULT == "voice-cpu"
    cfg = server_config(load_pipeline(DEFAULT_PIPELINE))
    assert cfg.voices == ("joe",) and cfg.default_voice == "joe"


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(DEFAULT_PIPELINE, server_config(load_pipeline(DEFAULT_PIPELINE)))


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


@pytest.fixture(scope="module")
def prompt_ids() -> list[int]:
    prompts = prompt_side(load_pipeline(DEFAULT_PIPELINE))
    assert prompts is not None
    return prompts.encode_prompt(PROMPT)


def _answer(pipe: Pipeline, prompt_ids: list[int]) -> list[RequestOutput]:
    sampling = SamplingParams(temperature=0.2, top_p=0.9, seed=0, max_tokens=48)
    return list(pipe.submit(prompt_ids, modalities=["text", "audio"], sampling=sampling))


def _audio(outputs: list[RequestOutput]) -> torch.Tensor:
    return torch.cat([o.audio.reshape(-1) for o in outputs if o.modality == "audio" and o.audio is not None])


@pytest.fixture(scope="module")
def chunked_answer(served: Served, prompt_ids: list[int]) -> list[RequestOutput]:
    outputs = _answer(served.pipe, prompt_ids)
    served.audit()
    return outputs


def test_first_audio_comes_before_the_thinker_finishes(chunked_answer: list[RequestOutput]) -> None:
    """The orchestrator routes outputs in the order stages report them: a sentence's audio
    reached the client while the Thinker was still generating."""
    kinds = [(o.modality, o.stage_finished) for o in chunked_answer]
    first_audio = next(
        i for i, o in enumerate(chunked_answer) if o.modality == "audio" and o.audio is not None
    )
    thinker_done = kinds.index(("text", True))
    assert first_audio < thinker_done, kinds
    audio_pieces = [
        o for o in chunked_answer if o.modality == "audio" and o.audio is not None and o.audio.numel()
    ]
    assert len(audio_pieces) >= 2  # one per sentence
    assert all(o.sample_rate == RATE for o in audio_pieces)


def test_streamed_audio_equals_the_complete_input_audio(
    chunked_answer: list[RequestOutput], prompt_ids: list[int]
) -> None:
    """The same prompt and seeds with the Thinker -> voice edge not chunked: the voice gets
    the finished text at once, and speaks exactly the same samples."""
    pipe = Pipeline.start(DEFAULT_PIPELINE, async_chunk=False)
    try:
        whole = _answer(pipe, prompt_ids)
        audit_running(pipe)
    finally:
        audit_stopped(pipe)
    text = "".join(o.text or "" for o in chunked_answer if o.modality == "text")
    assert "".join(o.text or "" for o in whole if o.modality == "text") == text
    assert [o.modality for o in whole if o.audio is not None and o.audio.numel()] == ["audio"]  # one piece
    assert torch.equal(_audio(whole), _audio(chunked_answer))


# --------------------------------------------------------------------------- serving


def _check_words(stamps: Any, text: str, duration_ms: float) -> None:
    assert isinstance(stamps, list)
    assert [w["word"] for w in stamps] == text.replace(",", "").replace(".", "").split()
    end = 0
    for w in stamps:
        assert end <= w["start_ms"] < w["end_ms"] <= duration_ms  # monotonic, inside the audio
        end = w["end_ms"]


def test_speech_is_read_verbatim_with_word_timestamps(srv: Served) -> None:
    resp = httpx.post(
        srv.url + SPEECH,
        json={
            "model": srv.model,
            "input": TEXT,
            "voice": "joe",
            "word_timestamps": True,
            "response_format": "wav",
        },
        timeout=300,
    )
    assert resp.status_code == 200, resp.text
    pcm, rate = parse_wav(resp.content)
    assert rate == RATE
    _check_words(json.loads(resp.headers["x-word-timestamps"]), TEXT, len(pcm) / rate * 1000)
    heard = Recognizer().words(np.asarray(pcm, dtype=np.float32) / 32768.0, rate)
    assert word_error_rate(spoken_words(TEXT), heard) <= 0.25, heard


async def _ws(url: str, text: str) -> list[Any]:
    cfg = {
        "type": "session.config",
        "response_format": "pcm",
        "stream_audio": True,
        "word_timestamps": True,
        "split": "sentence",
        "voice": "joe",
    }
    out: list[Any] = []
    async with websockets.connect(url) as ws:
        for msg in (cfg, {"type": "input.text", "text": text}, {"type": "input.done"}):
            await ws.send(json.dumps(msg))
        await ws.send(json.dumps({"type": "session.close"}))
        async for m in ws:
            out.append(m)
    return out


def test_websocket_streams_each_sentence_with_word_timestamps(srv: Served) -> None:
    events = [json.loads(m) for m in asyncio.run(_ws(srv.ws_url, TEXT)) if isinstance(m, str)]
    sentences = ["Good morning to you all.", "The train leaves at nine o'clock sharp."]
    starts = [e for e in events if e["type"] == "audio.start"]
    assert [e["sentence_text"] for e in starts] == sentences
    assert all(e["sample_rate"] == PCM_RATE and e["word_timestamps"] is True for e in starts)
    for index, sentence in enumerate(sentences):
        chunks = [e for e in events if e["type"] == "audio.chunk" and _sentence_of(events, e) == index]
        *body, trailer = chunks
        audio = b"".join(base64.b64decode(str(c["audio_b64"])) for c in body)
        assert body and audio and trailer["audio_b64"] == ""
        assert all(c["sample_rate"] == PCM_RATE for c in chunks)
        _check_words(trailer["timestamps"], sentence, len(audio) / 2 / PCM_RATE * 1000)
    done = [e for e in events if e["type"] == "audio.done"]
    assert [d["error"] for d in done] == [None, None]
    assert events[-1]["type"] == "session.done"


async def _ws_speech(url: str, fmt: str, text: str) -> tuple[dict[str, Any], bytes]:
    """One utterance over the WebSocket in ``fmt``: its ``audio.start`` and its bytes."""
    events: list[dict[str, Any]] = []
    audio = b""
    async with websockets.connect(url) as ws:
        for msg in (
            {"type": "session.config", "response_format": fmt, "voice": "joe"},
            {"type": "input.text", "text": text},
            {"type": "input.done"},
            {"type": "session.close"},
        ):
            await ws.send(json.dumps(msg))
        async for m in ws:
            if isinstance(m, bytes):
                audio += m
            else:
                events.append(json.loads(m))
    assert [e["type"] for e in events] == ["audio.start", "audio.done", "session.done"], events
    assert events[1]["total_bytes"] == len(audio) and events[1]["error"] is None
    return events[0], audio


def _decoded(data: bytes, fmt: str, rate: int) -> tuple[int, int]:
    """``(samples, sample rate)`` of a body, decoded with PyAV (raw pcm: as s16le at ``rate``)."""
    options = {"sample_rate": str(rate), "ch_layout": "mono"} if fmt == "pcm" else {}
    with av.open(io.BytesIO(data), format="s16le" if fmt == "pcm" else None, options=options) as container:
        stream = container.streams.audio[0]
        num_samples = sum(frame.samples for frame in container.decode(stream))
        return num_samples, stream.codec_context.sample_rate


#: The rate each format is sent at for the 22,050 Hz voice: the encoders' own (encoding.py).
FORMAT_RATES = {"mp3": RATE, "opus": 48000, "aac": RATE, "flac": RATE, "wav": RATE, "pcm": PCM_RATE}


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_the_websocket_speaks_every_format_as_the_speech_endpoint(srv: Served, fmt: str) -> None:
    """The same two sentences over ``/v1/audio/speech`` and the WebSocket (one utterance,
    ``split: none``): the streamed bytes decode to as many samples, at the same rate, as
    the HTTP response's; ``audio.start`` names that rate."""
    http = httpx.post(
        srv.url + SPEECH,
        json={"model": srv.model, "input": TEXT, "voice": "joe", "response_format": fmt},
        timeout=300,
    )
    assert http.status_code == 200, http.text
    start, streamed = asyncio.run(_ws_speech(srv.ws_url, fmt, TEXT))
    assert start["format"] == fmt and start["sample_rate"] == int(http.headers["x-sample-rate"])
    want, rate = _decoded(http.content, fmt, start["sample_rate"])
    got, got_rate = _decoded(streamed, fmt, start["sample_rate"])
    assert got_rate == rate == FORMAT_RATES[fmt]
    assert got == want and want > rate  # over a second of speech, to the sample


def _sentence_of(events: list[dict[str, Any]], event: dict[str, Any]) -> int:
    """The sentence index an audio.chunk belongs to: the last audio.start before it."""
    index = -1
    for e in events:
        if e["type"] == "audio.start":
            index = e["sentence_index"]
        if e is event:
            return index
    raise AssertionError("event not found")


def test_chat_answers_in_text_and_speech(srv: Served) -> None:
    r = srv.client().chat.completions.create(
        model=srv.model,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "wav"},
    )
    message = r.choices[0].message
    assert message.content is None and "Paris" in message.audio.transcript  # spoken: OpenAI's shape
    pcm, rate = parse_wav(base64.b64decode(message.audio.data))
    assert rate == RATE and len(pcm) > RATE // 2


QUESTION = "What is the capital of France?"


def _words(text: str) -> list[str]:
    return "".join(c if c.isalnum() or c.isspace() else " " for c in text.lower()).split()


def test_a_spoken_question_is_heard_and_answered(srv: Served) -> None:
    """The question, spoken by the pipeline's own voice (speech endpoint, WAV at 22.05 kHz),
    sent back as an ``input_audio`` part: the recognizer stage hears it (its transcript is
    the user turn) and the Thinker answers it, in text and speech. The transcript is read
    off the same request through the Python API; the text-only request right after it
    skips the recognizer (its prompt is the plain chat prompt)."""
    spoken = httpx.post(
        srv.url + SPEECH, json={"model": srv.model, "input": QUESTION, "response_format": "wav"}, timeout=300
    )
    assert spoken.status_code == 200, spoken.text
    part = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(spoken.content).decode(), "format": "wav"},
    }
    r = srv.client().chat.completions.create(
        model=srv.model,
        messages=[{"role": "user", "content": [part]}],
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "wav"},
    )
    message = r.choices[0].message
    assert message.content is None and "Paris" in message.audio.transcript, message
    pcm, rate = parse_wav(base64.b64decode(message.audio.data))
    assert rate == RATE and len(pcm) > RATE // 2
    srv.audit()
    # The transcript itself, through the API on the same pipeline.
    pcm16k = decode_audio(spoken.content, "wav", sample_rate=AUDIO_INPUT_RATE)
    handle = srv.pipe.submit(
        [0],
        modalities=["text"],
        inputs=audio_inputs([pcm16k]),
        extras={"chat_turns": [["user", [{"audio": 0}]]]},
        entry_stage_id=srv.pipe.config.audio_entry_stage_id,
    )
    outputs = list(handle)
    (heard,) = [o.text for o in outputs if o.modality == "transcript"]
    assert _words(heard) == _words(QUESTION), heard
    assert "Paris" in "".join(o.text or "" for o in outputs if o.modality == "text")
    # Aborted while the recognizer holds it: nothing of it is left in any stage.
    handle = srv.pipe.submit(
        [0],
        modalities=["text", "audio"],
        inputs=audio_inputs([pcm16k]),
        extras={"chat_turns": [["user", [{"audio": 0}]]]},
        entry_stage_id=0,
    )
    handle.abort()
    assert [o.finish_reason for o in handle if o.finished] == ["abort"]


def _recognized(srv: Served) -> dict[str, int]:
    engine = srv.pipe.health().stages[0].engine
    assert engine is not None and engine["stage"] == "asr"
    return dict(engine["num_finished_by_reason"])


def test_text_chat_skips_the_recognizer(srv: Served) -> None:
    before = _recognized(srv)
    text = srv.client().chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": QUESTION}], max_tokens=8
    )
    assert "Paris" in (text.choices[0].message.content or "")
    assert _recognized(srv) == before  # the request never reached the recognizer


def test_an_image_part_is_refused_by_the_text_only_thinker(srv: Served) -> None:
    png = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()
    content = [{"type": "text", "text": QUESTION}, {"type": "image_url", "image_url": {"url": png}}]
    with pytest.raises(
        openai.BadRequestError, match=r"content\[1\] has type 'image_url'; this model takes no image"
    ):
        srv.client().chat.completions.create(model=srv.model, messages=[{"role": "user", "content": content}])
    assert httpx.get(srv.url + "/health").status_code == 200


def test_a_killed_voice_fails_its_request_at_once_and_comes_back(srv: Served, prompt_ids: list[int]) -> None:
    """Last in the module (it replaces the voice's process): the Piper voice is SIGKILLed
    right after an answer's first audio; the request ends within 2 s with
    ``stage_unavailable``, the voice restarts (docs/design.md §10) and chat with audio works
    again over HTTP."""
    pipe = srv.pipe
    sampling = SamplingParams(temperature=0.2, top_p=0.9, seed=0, max_tokens=48)
    handle = pipe.submit(prompt_ids, modalities=["text", "audio"], sampling=sampling)
    next(o for o in handle if o.modality == "audio" and o.audio is not None and o.audio.numel())
    t0 = time.monotonic()
    os.kill(pipe.pids()[2] or 0, signal.SIGKILL)
    with pytest.raises(StageUnavailableError, match=r"stage 2 \(voice\).*killed by SIGKILL"):
        handle.result(timeout=2.0)
    assert time.monotonic() - t0 < 2.0
    pipe.wait_ready(120)
    assert pipe.health().stages[2].num_restarts == 1
    test_chat_answers_in_text_and_speech(srv)
