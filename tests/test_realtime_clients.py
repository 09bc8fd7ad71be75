"""The voice-agent clients people use, against a live ``voice-cpu`` server with nothing
changed but the base URL (and the model's name): the official ``openai`` client's GA
``client.realtime.connect``, ``openai-agents``' ``RealtimeAgent`` / ``RealtimeRunner``, and
LiveKit Agents' ``openai.realtime.RealtimeModel`` through its session API. The last two
come with the ``agents`` extra (``pip install 'omnirelay[agents]'``); without it their
tests skip and say so.

* ``openai``: the session is accepted, a spoken question is heard (its input transcript
  the words said) and answered (audio and a transcript that names Paris) under GA's
  names, and a truncate of the answer is acknowledged.
* ``openai-agents``: a typed question reaches the model; the answer's audio reaches the
  app, the turn ends (``agent_end``) and no event fails the SDK's validation.
* LiveKit: ``generate_reply`` answers with text and audio frames; a reply interrupted at
  its first audio frame and truncated where it was played (as its agent does when the
  user speaks over it) raises no error, and the session answers the next reply.

Every test ends with a leak audit.
"""

from __future__ import annotations

import asyncio
import base64
import importlib.util
import re
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from omnirelay.cli.serve import DEFAULT_PIPELINE, server_config
from omnirelay.pipeline import load_pipeline
from tests.realtime_support import noise
from tests.serving_support import Served, serve

RATE = 24000
QUESTION = "What is the capital of France?"


def needs(module: str) -> pytest.MarkDecorator:
    try:
        missing = importlib.util.find_spec(module) is None
    except ModuleNotFoundError:  # a parent package is missing
        missing = True
    return pytest.mark.skipif(missing, reason=f"{module} is not installed: pip install 'omnirelay[agents]'")


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    yield from serve(DEFAULT_PIPELINE, server_config(load_pipeline(DEFAULT_PIPELINE)))


@pytest.fixture
def srv(served: Served) -> Iterator[Served]:
    yield served
    served.audit()


@pytest.fixture(scope="module")
def question(served: Served) -> bytes:
    """The question in the pipeline's voice between stretches of background noise, as
    pcm16 at 24 kHz."""
    resp = httpx.post(
        served.url + "/v1/audio/speech", json={"input": QUESTION, "response_format": "pcm"}, timeout=120
    )
    assert resp.status_code == 200
    served.audit()
    clip = np.frombuffer(resp.content, "<i2").astype(np.float32) / 32767
    signal = np.concatenate([noise(RATE, 0.6), clip, noise(RATE, 1.2, seed=3)])
    return (np.clip(signal, -1, 1) * 32767).round().astype("<i2").tobytes()


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z']+", text.lower())


def test_the_openai_ga_client_hears_a_spoken_question_and_answers_it(srv: Served, question: bytes) -> None:
    async def talk() -> dict[str, Any]:
        ws_base = srv.url.replace("http://", "ws://") + "/v1"
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="unused", websocket_base_url=ws_base)
        seen: dict[str, Any] = {"types": [], "audio": 0}
        async with client.realtime.connect(model=srv.model) as conn:
            await conn.session.update(
                session={
                    "type": "realtime",
                    "output_modalities": ["audio"],
                    "audio": {
                        "input": {
                            "format": {"type": "audio/pcm", "rate": RATE},
                            "transcription": {"model": "gpt-4o-mini-transcribe"},
                            "turn_detection": {"type": "semantic_vad"},
                        },
                        "output": {"voice": "alloy"},
                    },
                    "max_output_tokens": 24,
                }
            )
            for i in range(0, len(question), 4800):  # 100 ms a message
                await conn.input_audio_buffer.append(audio=base64.b64encode(question[i : i + 4800]).decode())
            async for event in conn:
                seen["types"].append(event.type)
                if event.type == "session.updated":
                    seen["session"] = event.session
                elif event.type == "conversation.item.input_audio_transcription.completed":
                    seen["heard"], seen["usage"] = event.transcript, event.usage
                elif event.type == "response.output_audio_transcript.done":
                    seen["said"] = event.transcript
                elif event.type == "response.output_audio.delta":
                    seen["audio"] += len(base64.b64decode(event.delta)) // 2
                elif event.type == "response.done":
                    seen["answer"] = event.response.output[0] if event.response.output else None
                    break
            answer_id = seen["answer"].id
            await conn.conversation.item.truncate(item_id=answer_id, content_index=0, audio_end_ms=500)
            async for event in conn:
                seen["types"].append(event.type)
                if event.type in ("conversation.item.truncated", "error"):
                    seen["truncated"] = event
                    break
        await client.close()
        return seen

    seen = asyncio.run(talk())
    assert seen["session"].type == "realtime" and seen["session"].audio.input.transcription is not None
    assert _words(seen["heard"]) == _words(QUESTION) and seen["usage"].type == "duration"
    assert "Paris" in seen["said"] and seen["audio"] > RATE // 2
    assert seen["answer"].content[0].type == "output_audio"
    assert not [t for t in seen["types"] if t.startswith(("response.audio", "response.text")) or t == "error"]
    truncated = seen["truncated"]
    assert truncated.type == "conversation.item.truncated" and truncated.audio_end_ms == 500


@needs("agents")
def test_openai_agents_realtime_runner_gets_audio_and_the_turn_ends(srv: Served) -> None:
    from agents.realtime import RealtimeAgent, RealtimeRunner

    async def talk() -> dict[str, Any]:
        agent = RealtimeAgent(name="assistant", instructions="Answer in one short sentence.")
        settings: Any = {
            "model_name": srv.model,
            "output_modalities": ["audio"],
            "max_output_tokens": 24,
            "turn_detection": {"type": "semantic_vad"},
        }
        runner = RealtimeRunner(agent, config={"model_settings": settings, "tracing_disabled": True})
        url = srv.url.replace("http://", "ws://") + f"/v1/realtime?model={srv.model}"
        seen: dict[str, Any] = {"audio": 0, "errors": [], "types": []}
        session = await runner.run(model_config={"url": url, "api_key": "unused"})
        async with session:
            await session.send_message(QUESTION)
            async with asyncio.timeout(120):
                async for event in session:
                    seen["types"].append(event.type)
                    if event.type == "audio":
                        seen["audio"] += len(event.audio.data)
                    elif event.type == "error":
                        seen["errors"].append(event.error)
                    elif event.type == "agent_end":
                        break
        return seen

    seen = asyncio.run(talk())
    assert seen["errors"] == [] and seen["audio"] > 0 and "agent_end" in seen["types"]


@needs("livekit.plugins.openai")
def test_livekit_realtime_model_replies_and_survives_an_interruption(srv: Served) -> None:
    import aiohttp
    from livekit.agents import llm
    from livekit.plugins import openai as lk_openai

    async def reply(session: Any, *, interrupt: bool = False) -> tuple[str, int, str]:
        """A reply's text, its audio samples and its message id; ``interrupt``: cut at its
        first audio frame, as the agent does when the user speaks over it."""
        gen = await asyncio.wait_for(session.generate_reply(), 60)
        text, samples, message_id = "", 0, ""
        async for message in gen.message_stream:
            message_id = message.message_id

            async def read(stream: Any) -> str:
                return "".join([piece async for piece in stream])

            said = asyncio.ensure_future(read(message.text_stream))
            async for frame in message.audio_stream:
                samples += frame.samples_per_channel
                if interrupt:
                    session.interrupt()
                    interrupt = False
            text += await said
        return text, samples, message_id

    async def talk() -> dict[str, Any]:
        seen: dict[str, Any] = {"errors": []}
        async with aiohttp.ClientSession() as http:
            model = lk_openai.realtime.RealtimeModel(
                model=srv.model, base_url=srv.url + "/v1", api_key="unused", http_session=http
            )
            session = model.session()
            session.on("error", lambda e: seen["errors"].append(e))
            chat = llm.ChatContext()
            chat.add_message(role="user", content=QUESTION)
            await session.update_chat_ctx(chat)
            seen["first"] = await reply(session)
            # The user speaks over the next one: cut, and told how much of it was played.
            seen["cut"] = await reply(session, interrupt=True)
            played_ms = seen["cut"][1] * 1000 // RATE
            session.truncate(message_id=seen["cut"][2], modalities=["audio"], audio_end_ms=played_ms)
            seen["second"] = await reply(session)
            await session.aclose()
            await model.aclose()
        return seen

    seen = asyncio.run(talk())
    assert all(samples > 0 for _, samples, _ in (seen["first"], seen["cut"], seen["second"]))
    assert "Paris" in seen["first"][0] and seen["second"][0]
    assert [e for e in seen["errors"] if getattr(e, "recoverable", True) is False] == []
