"""The rows of docs/conformance.md marked supported, against a live ``voice-cpu`` server,
with the official ``openai`` client (chat audio, speech, transcriptions) and its Realtime
client (``client.beta.realtime``, events).

* ``pcm`` is 24 kHz (``X-Sample-Rate: 24000``) and lasts as long as the ``wav`` (at the
  voice's own 22,050 Hz) to within one sample period per 1,000.
* Chat with audio: the text is ``message.audio.transcript`` (``content`` null), streamed
  as ``delta.audio.transcript``; ``pcm16`` deltas are 24 kHz.
* ``/v1/audio/transcriptions`` on the question spoken by the pipeline's own voice: the
  words exactly, in every response format, with word timestamps inside the audio; what
  the recognizer cannot do is a 400 naming the field.
* Realtime: a spoken question in OpenAI's 24 kHz ``pcm16``, sent by a client that sets
  only OpenAI's session fields (server VAD, ``input_audio_transcription``), said by another
  voice than the pipeline's (its voice played 10 % faster: higher and quicker, as no
  permissively licensed second voice ships as a wheel), is heard as the transcription
  endpoint hears the same clip and answered as chat answers it.

Every test ends with a leak audit.
"""

from __future__ import annotations

import asyncio
import base64
import io
import re
import wave
from collections.abc import Iterator
from typing import Any

import numpy as np
import openai
import pytest

from omnirelay.cli.serve import DEFAULT_PIPELINE, server_config
from omnirelay.pipeline import load_pipeline
from omnirelay.serving.media.audio_in import decode_audio
from omnirelay.serving.media.audio_out import wav_bytes
from tests.realtime_support import noise
from tests.serving_support import Served, chat_stream_audio, serve

QUESTION = "What is the capital of France?"
PCM_RATE = 24000


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(DEFAULT_PIPELINE, server_config(load_pipeline(DEFAULT_PIPELINE)))


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


@pytest.fixture(scope="module")
def question_wav(served: Served) -> bytes:
    """The question in the pipeline's own voice, a WAV at the voice's rate."""
    wav = served.client().audio.speech.create(
        model=served.model, voice="alloy", input=QUESTION, response_format="wav"
    )
    served.audit()
    return wav.content


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def _wav(data: bytes) -> tuple[np.ndarray, int]:
    with wave.open(io.BytesIO(data)) as w:
        return np.frombuffer(w.readframes(w.getnframes()), "<i2"), w.getframerate()


# ------------------------------------------------------------------------------- speech


def test_speech_pcm_is_24_khz_and_as_long_as_the_wav(srv: Served, question_wav: bytes) -> None:
    client = srv.client()
    pcm = client.audio.speech.with_raw_response.create(
        model=srv.model, voice="alloy", input=QUESTION, response_format="pcm"
    )
    assert pcm.headers["x-sample-rate"] == "24000"
    samples, rate = _wav(question_wav)
    assert rate == 22050  # wav keeps the voice's rate: its header says it
    wav_s, pcm_s = samples.size / rate, len(pcm.content) / 2 / PCM_RATE
    # within one sample period per 1,000 samples
    assert abs(pcm_s - wav_s) <= samples.size / 1000 / rate, (wav_s, pcm_s)


def test_speech_instructions_are_refused_by_a_voice_that_cannot_take_them(srv: Served) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        srv.client().audio.speech.create(
            model=srv.model, voice="alloy", input="Hello.", instructions="Speak like a pirate."
        )
    assert info.value.body["param"] == "instructions"  # type: ignore[index]


# --------------------------------------------------------------------------- chat audio


def test_chat_audio_text_is_the_audio_transcript(srv: Served) -> None:
    client = srv.client()
    messages: Any = [{"role": "user", "content": QUESTION}]
    whole = client.chat.completions.create(
        model=srv.model,
        messages=messages,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "wav"},
        max_tokens=24,
    )
    message = whole.choices[0].message
    assert message.content is None and message.audio is not None
    assert "Paris" in message.audio.transcript
    samples, rate = _wav(base64.b64decode(message.audio.data))
    assert rate == 22050 and samples.size > rate // 2
    stream = client.chat.completions.create(
        model=srv.model,
        messages=messages,
        modalities=["text", "audio"],
        audio={"voice": "alloy", "format": "pcm16"},
        max_tokens=24,
        stream=True,
    )
    text, audio, chunks = chat_stream_audio(stream)
    assert text == message.audio.transcript  # the same seed, the same answer
    assert not any(c.choices and c.choices[0].delta.content for c in chunks)
    # pcm16 at 24 kHz: as long as the wav answer, to within a sample period per 1,000
    assert abs(len(audio) / 2 / PCM_RATE - samples.size / rate) <= samples.size / 1000 / rate


# ------------------------------------------------------------------------ transcriptions


def test_transcriptions_hear_the_question_word_for_word(srv: Served, question_wav: bytes) -> None:
    client = srv.client()
    file = ("question.wav", question_wav)
    plain = client.audio.transcriptions.create(model=srv.model, file=file)
    assert _words(plain.text) == _words(QUESTION)
    verbose = client.audio.transcriptions.create(
        model=srv.model,
        file=file,
        response_format="verbose_json",
        timestamp_granularities=["word", "segment"],
    )
    samples, rate = _wav(question_wav)
    assert verbose.words is not None and verbose.segments is not None
    assert [w.word for w in verbose.words] == _words(QUESTION)
    ends = [0.0] + [w.end for w in verbose.words]
    assert all(a <= w.start < w.end for a, w in zip(ends, verbose.words))  # in order, no overlap
    assert verbose.words[-1].end <= samples.size / rate + 0.01
    assert abs(verbose.duration - samples.size / rate) < 0.01 and verbose.language == "english"
    assert " ".join(s.text for s in verbose.segments) == verbose.text
    text = client.audio.transcriptions.create(model=srv.model, file=file, response_format="text")
    assert _words(str(text)) == _words(QUESTION)
    srt = str(client.audio.transcriptions.create(model=srv.model, file=file, response_format="srt"))
    assert re.match(r"1\n00:00:\d\d,\d{3} --> 00:00:\d\d,\d{3}\nwhat is the capital of france\n", srt), srt
    vtt = str(client.audio.transcriptions.create(model=srv.model, file=file, response_format="vtt"))
    assert vtt.startswith("WEBVTT\n\n00:00:") and "what is the capital of france" in vtt


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"prompt": "Paris"}, "prompt"),
        ({"language": "fr"}, "language"),
        ({"temperature": 0.5}, "temperature"),
        ({"response_format": "diarized_json"}, "response_format"),
        ({"timestamp_granularities": ["word"]}, "timestamp_granularities"),
        ({"file": ("question.txt", b"hello")}, "file"),
    ],
)
def test_transcriptions_refuse_what_the_recognizer_cannot_do(
    srv: Served, question_wav: bytes, kwargs: dict[str, Any], param: str
) -> None:
    args: dict[str, Any] = {"model": srv.model, "file": ("question.wav", question_wav), **kwargs}
    with pytest.raises(openai.BadRequestError) as info:
        srv.client().audio.transcriptions.create(**args)
    assert info.value.body["param"] == param  # type: ignore[index]


# ------------------------------------------------------------------------------ realtime


def _another_voice(wav: bytes) -> np.ndarray:
    """The voice's question played 10 % faster (higher and quicker), at 24 kHz."""
    samples, rate = _wav(wav)
    faster = wav_bytes(samples.astype(np.float32) / 32767, round(rate * 1.1))
    return decode_audio(faster, "wav", sample_rate=PCM_RATE)


def test_realtime_hears_openai_pcm16_as_chat_does(srv: Served, question_wav: bytes) -> None:
    clip = _another_voice(question_wav)
    signal = np.concatenate([noise(PCM_RATE, 0.5), clip, noise(PCM_RATE, 1.2, seed=3)])
    as_wav = wav_bytes(signal, PCM_RATE)
    client = srv.client()
    heard = client.audio.transcriptions.create(model=srv.model, file=("clip.wav", as_wav)).text
    assert _words(heard) == _words(QUESTION)
    part: Any = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(as_wav).decode(), "format": "wav"},
    }
    chat = client.chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": [part]}], max_tokens=24
    )
    answer = chat.choices[0].message.content or ""
    assert "Paris" in answer

    async def talk() -> dict[str, Any]:
        ws_base = srv.url.replace("http://", "ws://") + "/v1"
        rt = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", websocket_base_url=ws_base)
        seen: dict[str, Any] = {"types": []}
        async with rt.beta.realtime.connect(model=srv.model) as conn:
            await conn.session.update(
                session={
                    "turn_detection": {"type": "server_vad"},
                    "input_audio_transcription": {"model": "whisper-1"},
                    "max_response_output_tokens": 24,
                }
            )
            pcm = (np.clip(signal, -1, 1) * 32767).round().astype("<i2").tobytes()
            for i in range(0, len(pcm), 4800):  # 100 ms a message
                await conn.input_audio_buffer.append(audio=base64.b64encode(pcm[i : i + 4800]).decode())
            async for event in conn:
                seen["types"].append(event.type)
                if event.type == "session.updated":
                    seen["session"] = event.session
                elif event.type == "conversation.item.input_audio_transcription.completed":
                    seen["heard"] = event.transcript
                elif event.type == "response.audio_transcript.done":
                    seen["said"] = event.transcript
                elif event.type == "response.audio.delta":
                    seen["audio"] = seen.get("audio", 0) + len(base64.b64decode(event.delta)) // 2
                elif event.type == "response.done":
                    seen["status"] = event.response.status
                    break
        await rt.close()
        return seen

    seen = asyncio.run(talk())
    assert seen["session"].input_audio_transcription.model == "whisper-1"
    order = [t for t in seen["types"] if t.startswith("input_audio_buffer.")]
    assert order == [
        "input_audio_buffer.speech_started",
        "input_audio_buffer.speech_stopped",
        "input_audio_buffer.committed",
    ]
    assert _words(seen["heard"]) == _words(heard)  # heard as the transcription endpoint hears it
    assert seen["said"] == answer and seen["status"] == "completed"  # answered as chat answers it
    assert seen["audio"] > PCM_RATE // 2
