"""The rows of docs/conformance.md marked supported, against a live ``voice-cpu`` server,
with the official ``openai`` client (chat audio, speech, transcriptions) and its Realtime
client (``client.beta.realtime``, events).

* ``pcm`` is 24 kHz (``X-Sample-Rate: 24000``) and lasts as long as the ``wav`` (at the
  voice's own 22,050 Hz) to within one sample period per 1,000.
* Chat with audio: the text is ``message.audio.transcript`` (``content`` null), streamed
  as ``delta.audio.transcript``; ``pcm16`` deltas are 24 kHz. Chat's sampling:
  ``temperature`` 0 is greedy, ``seed`` repeats a draw, a ``top_p`` that leaves one token
  is greedy again, ``max_completion_tokens`` bounds the answer.
* ``/v1/audio/transcriptions`` on the question spoken by the pipeline's own voice: the
  words exactly, in every response format, with word timestamps inside the audio; what
  the recognizer cannot do is a 400 naming the field.
* Realtime: a spoken question in OpenAI's 24 kHz ``pcm16``, sent by a client that sets
  only OpenAI's session fields (server VAD, ``input_audio_transcription``), is heard as
  the transcription endpoint and chat hear the same clip and answered as chat answers it:
  said by the pipeline's voice played 10 % faster (higher and quicker), and by another
  voice altogether (eSpeak NG's ``en-us``, ``tests/fixtures/espeak-en-us-question.wav``,
  made once with eSpeak NG 1.51: ``espeak-ng -v en-us -w
  tests/fixtures/espeak-en-us-question.wav "What is the capital of France?"``), which the
  recognizer hears wrong — the same wrong words whichever endpoint the clip came through.
  A session's ``temperature`` and ``instructions`` and a response's ``temperature`` sample
  the answer as chat's ``temperature`` and system message do.

Every test ends with a leak audit.
"""

from __future__ import annotations

import asyncio
import base64
import io
import re
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest

from omnirelay.cli.serve import DEFAULT_PIPELINE, server_config
from omnirelay.models.inputs import AUDIO_INPUT_RATE, audio_inputs
from omnirelay.pipeline import load_pipeline
from omnirelay.serving.media.audio_in import decode_audio
from omnirelay.serving.media.audio_out import wav_bytes
from tests.realtime_support import RealtimeClient, noise
from tests.serving_support import Served, chat_stream_audio, serve

QUESTION = "What is the capital of France?"
PCM_RATE = 24000
#: The question said by eSpeak NG's en-us voice (see the module docstring).
ESPEAK_QUESTION = Path(__file__).parent / "fixtures" / "espeak-en-us-question.wav"
FRUIT = "Name a fruit."
FRENCH = "Answer in French."


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


def test_chat_temperature_top_p_seed_and_max_completion_tokens(srv: Served) -> None:
    """The prompt stage's sampling, as OpenAI's: ``temperature`` 0 is greedy (a seed changes
    nothing); above it the answer is drawn, the same for the same ``seed`` and another for
    another; a ``top_p`` that leaves only the likeliest token is greedy again;
    ``max_completion_tokens`` bounds the answer (over ``max_tokens``)."""
    client = srv.client()

    def ask(**kwargs: Any) -> str:
        r = client.chat.completions.create(
            model=srv.model, messages=[{"role": "user", "content": FRUIT}], max_completion_tokens=8, **kwargs
        )
        return r.choices[0].message.content or ""

    greedy = ask(temperature=0)
    assert ask(temperature=0, seed=7) == greedy
    drawn = ask(temperature=1.5, top_p=1.0, seed=1)
    assert ask(temperature=1.5, top_p=1.0, seed=1) == drawn
    other = ask(temperature=1.5, top_p=1.0, seed=2)
    assert len({greedy, drawn, other}) == 3, (greedy, drawn, other)
    assert ask(temperature=1.5, top_p=1e-9, seed=2) == greedy
    bounded = client.chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": FRUIT}], max_tokens=40, max_completion_tokens=3
    )
    assert bounded.usage is not None and bounded.usage.completion_tokens == 3
    assert bounded.choices[0].finish_reason == "length"


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
        ({"stream": True}, "stream"),
        ({"include": ["logprobs"]}, "include"),
        ({"chunking_strategy": "auto"}, "chunking_strategy"),
        ({"known_speaker_names": ["ann"]}, "known_speaker_names"),
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


def _realtime_turn(srv: Served, signal: np.ndarray) -> dict[str, Any]:
    """``signal`` (24 kHz) spoken to a realtime session by OpenAI's client, setting only
    OpenAI's session fields: what the session said (its events' types, the session, the
    transcript, the answer, its audio and status)."""

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
    return seen


#: a realtime response's status for a chat answer's finish reason
STATUS = {"stop": "completed", "length": "incomplete"}


def _chat_hears(srv: Served, wav: bytes) -> tuple[str, str, str]:
    """``(transcript, answer, finish reason)`` of a WAV sent as chat's ``input_audio``: the
    transcript read off the recognizer's output of the request chat makes of it (through
    the API; chat itself shows only the answer), the answer from chat."""
    clip = decode_audio(wav, "wav", sample_rate=AUDIO_INPUT_RATE)  # as the chat route decodes it
    handle = srv.pipe.submit(
        [0],
        modalities=["text"],
        inputs=audio_inputs([clip]),
        extras={"chat_turns": [["user", [{"audio": 0}]]]},
        entry_stage_id=srv.pipe.config.audio_entry_stage_id,
    )
    heard = next(o.text or "" for o in handle if o.modality == "transcript")
    handle.abort()  # the transcript is all this request is for; chat's answers below
    assert [o.finish_reason for o in handle if o.finished] == ["abort"]
    part: Any = {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"},
    }
    chat = srv.client().chat.completions.create(
        model=srv.model, messages=[{"role": "user", "content": [part]}], max_tokens=24
    )
    return heard, chat.choices[0].message.content or "", chat.choices[0].finish_reason


def test_realtime_hears_openai_pcm16_as_chat_does(srv: Served, question_wav: bytes) -> None:
    clip = _another_voice(question_wav)
    signal = np.concatenate([noise(PCM_RATE, 0.5), clip, noise(PCM_RATE, 1.2, seed=3)])
    as_wav = wav_bytes(signal, PCM_RATE)
    heard = srv.client().audio.transcriptions.create(model=srv.model, file=("clip.wav", as_wav)).text
    assert _words(heard) == _words(QUESTION)
    _, answer, finish = _chat_hears(srv, as_wav)
    assert "Paris" in answer
    seen = _realtime_turn(srv, signal)
    assert _words(seen["heard"]) == _words(heard)  # heard as the transcription endpoint hears it
    assert seen["said"] == answer and seen["status"] == STATUS[finish]  # answered as chat answers it
    assert seen["audio"] > PCM_RATE // 2


def test_realtime_hears_another_voice_as_chat_and_transcriptions_do(srv: Served) -> None:
    """eSpeak NG's en-us voice, which the recognizer mishears: the realtime turn (the
    server VAD's segment: its speech with 300 ms before and 500 ms after) is heard as the
    whole clip is by the transcription endpoint and by chat — the same words — and
    answered as chat answers it."""
    clip = decode_audio(ESPEAK_QUESTION.read_bytes(), "wav", sample_rate=PCM_RATE)
    signal = np.concatenate([noise(PCM_RATE, 0.5), clip, noise(PCM_RATE, 1.2, seed=3)])
    as_wav = wav_bytes(signal, PCM_RATE)
    transcribed = srv.client().audio.transcriptions.create(model=srv.model, file=("clip.wav", as_wav)).text
    chat_heard, chat_answer, finish = _chat_hears(srv, as_wav)
    seen = _realtime_turn(srv, signal)
    assert _words(seen["heard"]) == _words(transcribed) == _words(chat_heard) != [], (
        seen["heard"],
        transcribed,
    )
    assert seen["said"] == chat_answer and seen["status"] == STATUS[finish]


def test_realtime_temperature_and_instructions_sample_as_chat_does(srv: Served) -> None:
    """A session's ``temperature`` and ``instructions`` (the system turn), and a
    ``response.create``'s ``temperature``, ``instructions`` and ``modalities`` over the
    session's: each answer is chat's with that temperature and system message (the prompt
    stage's seed makes a draw repeat)."""
    client = srv.client()

    def chat(temperature: float, system: str | None = None) -> str:
        messages: Any = [{"role": "system", "content": system}] if system else []
        r = client.chat.completions.create(
            model=srv.model,
            messages=[*messages, {"role": "user", "content": FRUIT}],
            temperature=temperature,
            max_tokens=8,
        )
        return r.choices[0].message.content or ""

    greedy, drawn, instructed = chat(0), chat(1.5), chat(0, FRENCH)
    assert len({greedy, drawn, instructed}) == 3, (greedy, drawn, instructed)

    async def realtime(session: dict[str, Any], response: dict[str, Any] | None = None) -> str:
        c = await RealtimeClient.connect(srv.url.replace("http://", "ws://") + "/v1/realtime")
        await c.send({"type": "session.update", "session": {"max_response_output_tokens": 8, **session}})
        updated = (await c.until("session.updated"))["session"]
        assert updated["temperature"] == session["temperature"]
        assert updated["instructions"] == session.get("instructions", "")
        done = await c.text_turn(FRUIT, response)
        await c.close()
        assert not c.of("response.audio.delta")  # a text answer, as the modalities say
        return str(done["response"]["output"][0]["content"][0]["text"])

    text = ["text"]
    assert asyncio.run(realtime({"modalities": text, "temperature": 0})) == greedy
    assert asyncio.run(realtime({"modalities": text, "temperature": 1.5})) == drawn
    assert asyncio.run(realtime({"modalities": text, "temperature": 0}, {"temperature": 1.5})) == drawn
    assert asyncio.run(realtime({"modalities": text, "temperature": 0, "instructions": FRENCH})) == instructed
    response = {"modalities": text, "instructions": FRENCH}  # over the session's (text and audio)
    assert asyncio.run(realtime({"temperature": 0}, response)) == instructed
